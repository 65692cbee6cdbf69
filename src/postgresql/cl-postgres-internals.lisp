;;;; Every use of a symbol that cl-postgres does not export lives in this file.

(in-package #:hunchentoot-recycling-taskmaster)

(defun cut-database-connection (connection)
  "Shut CONNECTION's socket down in both directions, so that whatever
cl-postgres still reads or writes on it (its cleanups read to the end of a
reply) fails at once instead of waiting for the server."
  (let ((socket (cl-postgres::connection-socket connection)))
    (when (and socket (open-stream-p socket))
      (shut-down-fd (fd-stream-descriptor socket)))))

(defun database-connection-stream (connection)
  "The fd-stream CONNECTION talks to the server on."
  (cl-postgres::connection-socket connection))
