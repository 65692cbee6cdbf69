;;;; The streams a request body is read through -- the body octets that came
;;;; with the head first, then the connection -- and, after the request,
;;;; the octets of the next one moved to the start of the worker's buffer.

(in-package #:hunchentoot-recycling-taskmaster)

(defun content-stream-for (headers stream buffer body-start end)
  "The stream a request body is read from: the body octets already in BUFFER
from BODY-START below END, then STREAM; decoded from chunked if the client
says so.  Second value: the in-memory stream of the buffered octets, or NIL.
Third value: true when the content stream is chunked."
  (let* ((buffered (and (< body-start end)
                        (flex:make-in-memory-input-stream buffer :start body-start :end end)))
         (content (if buffered (make-concatenated-stream buffered stream) stream)))
    (if (assoc :transfer-encoding headers)
        (values (make-chunked-body-stream (if buffered (make-two-way-stream content stream) stream)
                                          (acceptor-max-body-bytes hunchentoot:*acceptor*))
                buffered t)
        (values content buffered nil))))

(defun unread-octets (in-memory-stream)
  (let ((octets (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (loop for octet = (read-byte in-memory-stream nil)
          while octet
          do (vector-push-extend octet octets))
    octets))

(defun drain-stream-buffer (stream buffer start)
  "Move the octets STREAM has read ahead of the request body into BUFFER from
START: they begin the next request.  The new end, or NIL when they do not fit."
  (let ((position (read-arrived-octets stream buffer start (length buffer))))
    (unless (and (= position (length buffer)) (listen stream))
      position)))

(defun next-request-octets (connection buffer body-p buffered head-end end)
  "After a request, move what is left of the client's input to the start of
BUFFER: the end of the octets that begin the next request, or NIL when they
do not fit (the connection is then closed)."
  (cond ((not body-p)
         (replace buffer buffer :start2 head-end :end2 end)
         (- end head-end))
        (t
         (let* ((unread (if buffered (unread-octets buffered) #()))
                (stream (connection-stream connection)))
           (replace buffer unread)
           (if (plain-connection-p connection)
               (drain-stream-buffer stream buffer (length unread))
               (length unread))))))
