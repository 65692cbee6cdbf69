;;;; A pool of PostgreSQL connections for one process: a request's store
;;;; call takes a connection for one statement and gives it back, so a
;;;; process holds at most MAX-SIZE connections whatever its worker count,
;;;; and never opens one per request.
;;;;
;;;; Locking: the pool's LOCK guards IDLE and OPEN-COUNT; a connection is
;;;; opened and used outside it.  A thread waits on AVAILABLE for a
;;;; connection when all MAX-SIZE are in use; the caller's deadline (see
;;;; CALL-WITH-SESSION-STORE) ends that wait, as every other.
;;;;
;;;; A connection whose use ended by a non-local exit (a deadline in the
;;;; middle of a statement, a broken socket) is closed, never given back:
;;;; its protocol state is unknown.  At a deadline its socket is shut down
;;;; before anything unwinds, since cl-postgres's own cleanups would wait
;;;; for the rest of the server's reply.  When a connection turns out broken, the
;;;; idle ones are closed too (a restarted server broke them all) and the
;;;; statement is tried once more on a new connection.

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (database-pool (:constructor make-database-pool (connect max-size)))
  "The connections of one process to one database."
  ;; A function of no arguments returning a new open cl-postgres connection,
  ;; ready for the statements of the pool's user.
  (connect nil :type function :read-only t)
  ;; The most connections open at once.
  (max-size 8 :type (integer 1) :read-only t)
  ;; Open connections no thread is using.
  (idle '() :type list)
  ;; Connections open, idle or in use, or being opened.
  (open-count 0 :type (integer 0))
  (lock (bt:make-lock "database pool") :read-only t)
  (available (bt:make-condition-variable :name "database connection available") :read-only t))

(defun broken-connection-error-p (condition)
  "True when CONDITION says a connection (rather than a statement) failed."
  (typep condition '(or cl-postgres:database-connection-error stream-error
                        cl-postgres-error:server-shutdown cl-postgres-error:admin-shutdown)))

(defun close-database-connection (connection)
  "Close CONNECTION without waiting for the server."
  (ignore-errors (cl-postgres:close-database connection)))

(defun take-database-connection (pool)
  "An open connection of POOL for this thread, and true when it was idle
(opened for an earlier statement) rather than opened now."
  (loop
    (bt:with-lock-held ((database-pool-lock pool))
      (cond ((database-pool-idle pool)
             (return (values (pop (database-pool-idle pool)) t)))
            ((< (database-pool-open-count pool) (database-pool-max-size pool))
             (incf (database-pool-open-count pool))
             (return (values (open-pooled-connection pool) nil)))
            (t
             (bt:condition-wait (database-pool-available pool) (database-pool-lock pool)))))))

(defun open-pooled-connection (pool)
  "A new connection of POOL, counted in its OPEN-COUNT (already incremented,
under the lock, which is released while the connection is opened)."
  (let ((connection nil))
    (bt:release-lock (database-pool-lock pool))
    (unwind-protect
         (setf connection (funcall (database-pool-connect pool)))
      (bt:acquire-lock (database-pool-lock pool))
      (unless connection
        (decf (database-pool-open-count pool))
        (bt:condition-notify (database-pool-available pool))))
    connection))

(defun give-back-database-connection (pool connection)
  "Make CONNECTION, which ended its statement normally, idle in POOL."
  (bt:with-lock-held ((database-pool-lock pool))
    (push connection (database-pool-idle pool))
    (bt:condition-notify (database-pool-available pool))))

(defun drop-database-connection (pool connection &key idle-too)
  "Close CONNECTION and forget it; with IDLE-TOO, close the idle connections too."
  (close-database-connection connection)
  (let ((idle '()))
    (bt:with-lock-held ((database-pool-lock pool))
      (when idle-too
        (rotatef idle (database-pool-idle pool)))
      (decf (database-pool-open-count pool) (1+ (length idle)))
      (bt:condition-notify (database-pool-available pool)))
    (mapc #'close-database-connection idle)))

(defun call-with-database-connection (pool function)
  "FUNCTION called with a connection of POOL; its values.  When a connection
that served an earlier statement turns out broken, the call is made once
more on a new one, unless the caller's deadline has passed."
  (flet ((call-once ()
           (multiple-value-bind (connection reused) (take-database-connection pool)
             (let ((done nil) (cut nil))
               (unwind-protect
                    (handler-bind ((error (lambda (condition)
                                            (when (and reused (not cut) (broken-connection-error-p condition))
                                              (drop-database-connection pool connection :idle-too t)
                                              (setf done :dropped)
                                              (return-from call-once (values :retry)))))
                                   ;; cl-postgres's cleanups read the rest of a reply while
                                   ;; they unwind, past the deadline: cut the socket first.
                                   (deadline-passed (lambda (condition)
                                                      (declare (ignore condition))
                                                      (setf cut t)
                                                      (cut-database-connection connection))))
                      (multiple-value-prog1 (funcall function connection)
                        (setf done t)))
                 (case done
                   ((t) (give-back-database-connection pool connection))
                   ((nil) (drop-database-connection pool connection))))))))
    (let ((values (multiple-value-list (call-once))))
      (if (equal values '(:retry))
          (call-once)
          (values-list values)))))

(defmacro with-database-connection ((connection pool) &body body)
  "Run BODY with CONNECTION bound to a connection of POOL, as CALL-WITH-DATABASE-CONNECTION."
  `(call-with-database-connection ,pool (lambda (,connection) ,@body)))

(defun close-database-pool (pool)
  "Close POOL's idle connections."
  (let ((idle '()))
    (bt:with-lock-held ((database-pool-lock pool))
      (rotatef idle (database-pool-idle pool))
      (decf (database-pool-open-count pool) (length idle)))
    (mapc #'close-database-connection idle)))
