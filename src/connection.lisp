;;;; The blocking engine's connection loop (:CONNECTION-ENGINE :BLOCKING):
;;;; Hunchentoot's own loop, with the worker's state reported to the pool
;;;; around every wait, so that STOP can end idle connections and a saturated
;;;; pool can reclaim them.  The default engine is readiness-engine.lisp.

(in-package #:hunchentoot-recycling-taskmaster)

(defun use-chunked-input-if-asked (acceptor headers-in)
  (let ((transfer-encodings (cdr (assoc :transfer-encoding headers-in))))
    (when (and transfer-encodings
               (member "chunked" (cl-ppcre:split "\\s*,\\s*" transfer-encodings)
                       :test #'equalp))
      (unless (hunchentoot:acceptor-input-chunking-p acceptor)
        (error "The client sent a chunked request body, but ~S does not accept chunked input."
               acceptor))
      (let ((stream (chunga:make-chunked-stream (current-connection-stream))))
        (setf (chunga:chunked-stream-input-chunking-p stream) t
              (current-connection-stream) stream)))))

(defun answer-request (acceptor taskmaster socket headers-in method uri protocol)
  "Answer one request.  True when the reply says \"Connection: close\" to hand
this worker to a queued connection."
  (let ((hunchentoot:*reply* (make-instance (hunchentoot:acceptor-reply-class acceptor)))
        (hunchentoot:*session* nil)
        (yield-p (yield-kept-alive-connections-p taskmaster)))
    (when yield-p
      ;; START-OUTPUT keeps a Connection header the reply already has.
      (setf (hunchentoot:header-out :connection) "Close"))
    (use-chunked-input-if-asked acceptor headers-in)
    (call-with-request-counted
     acceptor
     (lambda ()
       (hunchentoot:process-request
        (make-acceptor-request acceptor socket headers-in (current-connection-stream)
                               method uri protocol))))
    (finish-output (current-connection-stream))
    yield-p))

(defun serve-one-request (acceptor taskmaster worker socket)
  "Read one request from the connection and answer it.  True when the
connection stays open for another."
  (with-request-bindings ()
    (multiple-value-bind (headers-in method uri protocol)
        (read-request-head (current-connection-stream))
      (when method
        (note-request-started worker)
        (let ((yielded-p (answer-request acceptor taskmaster socket headers-in method uri protocol)))
          (note-request-finished taskmaster worker)
          (setf (current-connection-stream)
                (hunchentoot:reset-connection-stream acceptor (current-connection-stream)))
          (not (or yielded-p (finish-processing-connection-p))))))))

(defun close-connection-streams (socket-stream)
  ;; The client may be gone: errors while flushing or closing mean nothing now.
  (flet ((close-quietly (stream)
           (ignore-errors (finish-output stream))
           (ignore-errors (close stream :abort t))))
    (let ((stream (current-connection-stream)))
      (when (and stream (not (eq stream socket-stream)))
        (close-quietly stream)))
    (close-quietly socket-stream)))

(defmethod hunchentoot:process-connection ((acceptor parallel-acceptor) socket)
  (let ((worker *worker*))
    (if (null worker)
        ;; Served by some other taskmaster: Hunchentoot's own loop.
        (call-next-method)
        (let ((taskmaster (worker-taskmaster worker))
              (socket-stream (usocket:socket-stream socket)))
          (with-connection-bindings ()
            (unwind-protect
                 (when (note-waiting-for-request taskmaster worker t)
                   (setf (current-connection-stream)
                         (hunchentoot:initialize-connection-stream acceptor socket-stream))
                   (loop while (and (serve-one-request acceptor taskmaster worker socket)
                                    (note-waiting-for-request taskmaster worker nil))))
              (when (close-connection-stream-p)
                (close-connection-streams socket-stream))))))))

;;; Refusing a connection the pool has no room for.

(defparameter *service-unavailable-response*
  (let* ((body (concatenate 'string
                            "<html><head><title>503 Service Unavailable</title></head>"
                            "<body><h1>Service Unavailable</h1>"
                            "<p>Every worker thread is busy. Please retry.</p></body></html>"))
         (crlf (coerce '(#\Return #\Linefeed) 'string)))
    (map '(vector (unsigned-byte 8)) #'char-code
         (format nil "HTTP/1.1 503 Service Unavailable~AContent-Type: text/html; charset=iso-8859-1~A~
                      Content-Length: ~D~ARetry-After: 1~AConnection: close~A~A~A"
                 crlf crlf (length body) crlf crlf crlf crlf body)))
  "The whole reply, status line to body, sent to a refused connection.")

(defun discard-arrived-input (socket)
  "Read and drop what the client has sent so far, without waiting for more."
  (let ((stream (usocket:socket-stream socket)))
    (loop repeat 65536
          while (listen stream)
          do (read-byte stream nil))))

(defun reject-connection (socket)
  "Answer SOCKET with a complete 503 reply and close it, without waiting for
the client: the thread-making thread calls this and must not stall.  The
reply and FIN go out before the close, so a client whose request arrives
late still reads the reply before the reset its request provokes."
  (unwind-protect
       (ignore-errors
        (let ((stream (usocket:socket-stream socket)))
          (write-sequence *service-unavailable-response* stream)
          (finish-output stream))
        (shut-down-output socket)
        (discard-arrived-input socket))
    (ignore-errors (usocket:socket-close socket))))
