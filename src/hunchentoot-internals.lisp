;;;; Every use of a symbol that Hunchentoot 1.2.38 does not export lives in
;;;; this file, so that the next Hunchentoot breaks in one place.

(in-package #:hunchentoot-recycling-taskmaster)

(defun default-max-thread-count ()
  "Hunchentoot's default for MAX-THREAD-COUNT (100), so that a user who set it
sees the same default here."
  hunchentoot::*default-max-thread-count*)

(defun default-max-accept-count ()
  "Hunchentoot's default for MAX-ACCEPT-COUNT (MAX-THREAD-COUNT + 20)."
  hunchentoot::*default-max-accept-count*)

(defun acceptor-listen-socket (acceptor)
  (hunchentoot::acceptor-listen-socket acceptor))

(defun (setf acceptor-listen-socket) (socket acceptor)
  (setf (hunchentoot::acceptor-listen-socket acceptor) socket))

(defun acceptor-shutting-down-p (acceptor)
  "True once HUNCHENTOOT:STOP has begun on ACCEPTOR."
  (hunchentoot::acceptor-shutdown-p acceptor))

(defun (setf acceptor-shutting-down-p) (value acceptor)
  (setf (hunchentoot::acceptor-shutdown-p acceptor) value))

(defun acceptor-taskmaster (acceptor)
  (hunchentoot::acceptor-taskmaster acceptor))

(defun apply-connection-timeouts (acceptor socket)
  "Give SOCKET the acceptor's read and write timeouts, as Hunchentoot's own
ACCEPT-CONNECTIONS does."
  (hunchentoot::set-timeouts socket
                             (hunchentoot:acceptor-read-timeout acceptor)
                             (hunchentoot:acceptor-write-timeout acceptor)))

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
  hunchentoot::*hunchentoot-stream*)

(defun (setf current-connection-stream) (stream)
  (setf hunchentoot::*hunchentoot-stream* stream))

(defun close-connection-stream-p ()
  "False when a handler called HUNCHENTOOT:DETACH-SOCKET."
  hunchentoot::*close-hunchentoot-stream*)

(defun finish-processing-connection-p ()
  "True when the reply just sent ends the connection."
  hunchentoot::*finish-processing-socket*)

(defun read-request-head (stream)
  "Read a request line and headers from STREAM.  Returns the headers alist,
the method keyword, the URI string and the protocol keyword; NIL when the
client sent no request."
  (hunchentoot::get-request-data stream))

(defun call-with-request-counted (acceptor function)
  "Call FUNCTION with the acceptor's requests-in-progress counter raised, so
that a soft HUNCHENTOOT:STOP waits for it."
  (hunchentoot::do-with-acceptor-request-count-incremented acceptor function))

(defun make-acceptor-request (acceptor socket headers-in content-stream method uri protocol)
  (hunchentoot::acceptor-make-request acceptor socket
                                      :headers-in headers-in
                                      :content-stream content-stream
                                      :method method
                                      :uri uri
                                      :server-protocol protocol))
