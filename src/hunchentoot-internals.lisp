;;;; Every use of a symbol that Hunchentoot 1.2.38 does not export lives in
;;;; this file, so that the next Hunchentoot breaks in one place.

(in-package #:hunchentoot-recycling-taskmaster)

(defun default-max-thread-count ()
  "Hunchentoot's default for MAX-THREAD-COUNT (100), so that a user who set it
sees the same default here."
  hunchentoot::*default-max-thread-count*)

(defun default-max-accept-count ()
  "Hunchentoot's default for MAX-ACCEPT-COUNT (MAX-THREAD-COUNT + 20), which a
RECYCLING-TASKMASTER takes but does not need."
  hunchentoot::*default-max-accept-count*)

(defun acceptor-listen-socket (acceptor)
  "The usocket ACCEPTOR listens on while started."
  (hunchentoot::acceptor-listen-socket acceptor))

(defun (setf acceptor-listen-socket) (socket acceptor)
  (setf (hunchentoot::acceptor-listen-socket acceptor) socket))

(defun acceptor-shutting-down-p (acceptor)
  "True once HUNCHENTOOT:STOP has begun on ACCEPTOR."
  (hunchentoot::acceptor-shutdown-p acceptor))

(defun (setf acceptor-shutting-down-p) (value acceptor)
  (setf (hunchentoot::acceptor-shutdown-p acceptor) value))

(defun acceptor-server-name (acceptor)
  "What ACCEPTOR's replies say in their Server header."
  (hunchentoot::acceptor-server-name acceptor))

(defun acceptor-taskmaster (acceptor)
  "ACCEPTOR's taskmaster, which Hunchentoot does not export a reader for."
  (hunchentoot::acceptor-taskmaster acceptor))

(defmacro with-connection-bindings (() &body body)
  "Bind the per-connection specials that Hunchentoot's reply code reads and
writes: the connection stream and whether to close it at the end."
  `(let ((hunchentoot::*hunchentoot-stream* nil)
         (hunchentoot::*close-hunchentoot-stream* t))
     ,@body))

(defmacro with-request-bindings (() &body body)
  "Bind the per-request specials: *FINISH-PROCESSING-SOCKET* starts true and
START-OUTPUT clears it when the reply keeps the connection alive."
  `(let ((hunchentoot::*finish-processing-socket* t))
     ,@body))

(defun current-connection-stream ()
  "The stream Hunchentoot's reply code writes the current reply to."
  hunchentoot::*hunchentoot-stream*)

(defun (setf current-connection-stream) (stream)
  (setf hunchentoot::*hunchentoot-stream* stream))

(defun close-connection-stream-p ()
  "False when a handler called HUNCHENTOOT:DETACH-SOCKET."
  hunchentoot::*close-hunchentoot-stream*)

(defun finish-processing-connection-p ()
  "True when the reply just sent ends the connection."
  hunchentoot::*finish-processing-socket*)

(defun call-with-request-counted (acceptor function)
  "Call FUNCTION with ACCEPTOR's count of requests in progress raised, as
Hunchentoot's own connection loop does."
  (hunchentoot::do-with-acceptor-request-count-incremented acceptor function))

(defun content-type-charset (content-type)
  "The charset parameter of the Content-Type header value CONTENT-TYPE when
its type is text, as Hunchentoot reads it, else NIL."
  (nth-value 2 (hunchentoot::parse-content-type content-type)))

(defun (setf request-headers-in) (headers request)
  "Replace what HUNCHENTOOT:HEADERS-IN of REQUEST returns."
  (setf (slot-value request 'hunchentoot::headers-in) headers))
