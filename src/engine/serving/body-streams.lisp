;;;; The streams a request body that came with its head is read through,
;;;; and, after the request, the octets of the next one moved to the start
;;;; of the worker's buffer.

(in-package #:hunchentoot-recycling-taskmaster)

(defun content-stream-for (chunked-p stream buffer start end)
  "The stream a request body that has all arrived in BUFFER is read from.
A chunked one (CHUNKED-P) is decoded from the octets in BUFFER from START
below END, then STREAM: its decoder stops at the last chunk.  Any other is
its Content-Length octets from START below END and nothing after them: a
reader looking for an end the body lacks -- a multipart body without its
closing boundary -- meets the end of the body, not the next request's
octets or the socket.  Second value: the in-memory stream of a chunked
body's octets in BUFFER, or NIL."
  (if chunked-p
      (let* ((buffered (and (< start end) (make-octets-input-stream buffer :start start :end end)))
             (input (if buffered (make-concatenated-stream buffered stream) stream)))
        (values (make-chunked-body-stream (if buffered (make-two-way-stream input stream) stream)
                                          (acceptor-max-body-bytes hunchentoot:*acceptor*))
                buffered))
      (values (make-octets-input-stream buffer :start start :end end) nil)))

(defun drain-stream-buffer (stream buffer start)
  "Move the octets STREAM has read ahead of the request body into BUFFER from
START: they begin the next request.  The new end, or NIL when they do not fit."
  (let ((position (read-arrived-octets stream buffer start (length buffer))))
    (unless (and (= position (length buffer)) (listen stream))
      position)))

(defun next-request-octets (connection buffer chunked-p buffered next-start end)
  "After a request, move what is left of the client's input to the start of
BUFFER: the end of the octets that begin the next request, or NIL when they
do not fit (the connection is then closed).  A chunked body (CHUNKED-P) was
read through the in-memory stream BUFFERED and the connection's stream,
which hold the octets past it; otherwise the next request begins at
NEXT-START, past the head and its Content-Length body."
  (cond (chunked-p
         ;; The octets of BUFFERED not read are in BUFFER itself.
         (let ((unread (if buffered (- (stream-end buffered) (stream-index buffered)) 0)))
           (when buffered
             (replace buffer buffer :start2 (stream-index buffered) :end2 (stream-end buffered)))
           (if (plain-connection-p connection)
               (drain-stream-buffer (connection-stream connection) buffer unread)
               unread)))
        (t
         (replace buffer buffer :start2 next-start :end2 end)
         (- end next-start))))
