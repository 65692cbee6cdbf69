;;;; The reply to an HTTP/2 stream as its handler writes it: the stream its
;;;; request's connection stream is, to which the engine and Hunchentoot
;;;; write the reply as on HTTP/1.1 -- a status line, header lines, a blank
;;;; line, the body, never chunked (Hunchentoot chunks HTTP/1.1 only).  The
;;;; head is read back into HEADERS (RFC 9113 8.3.2: a status pseudo-header,
;;;; the connection's own headers left out); the body goes to the library
;;;; as it is written (QUEUE-HTTP2-REPLY-OCTETS), and leaves as DATA frames
;;;; as flow control lets it: at each FORCE-OUTPUT for a handler streaming
;;;; through SEND-HEADERS, with the other streams' replies for a body given
;;;; whole.  A body given whole by the engine (HAND-OVER-REPLY-BODY) is
;;;; queued as it is; one written piece by piece is copied, and its writer
;;;; waits while more than +HTTP2-REPLY-WRITE-OCTETS+ of it wait for the
;;;; client, as a writer on HTTP/1.1 waits for its socket.
;;;;
;;;; A reply stream is written by the one worker running its stream's
;;;; handler.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +http2-reply-write-octets+ (* 256 1024)
  "The octets of a reply written piece by piece that may wait for its
client before its writer waits for room.")

(defconstant +http2-reply-buffer-octets+ 4096
  "The buffer in which a reply's small writes gather before they are given
to the library as one piece.")

(defclass http2-reply-stream (trivial-gray-streams:fundamental-binary-output-stream)
  ((connection
    :initarg :connection :reader reply-stream-connection
    :documentation "The HTTP2-CONNECTION the stream belongs to.")
   (stream
    :initarg :stream :reader reply-stream-stream
    :documentation "The HTTP2-STREAM answered.")
   (head
    :initform (make-array 512 :element-type '(unsigned-byte 8)) :accessor reply-stream-head
    :documentation "The octets of the head written so far, until it is
whole; then NIL.")
   (head-end
    :initform 0 :accessor reply-stream-head-end :type fixnum
    :documentation "How many octets of HEAD are written.")
   (status
    :initform nil :accessor reply-stream-status
    :documentation "The reply's status once its head is whole, else NIL.")
   (headers
    :initform '() :accessor reply-stream-headers
    :documentation "The reply's header fields once its head is whole: an
alist of lower-case names and values.")
   (submitted-p
    :initform nil :accessor reply-stream-submitted-p
    :documentation "True once the HEADERS are submitted to the library.")
   (buffer
    :initform (make-array +http2-reply-buffer-octets+ :element-type '(unsigned-byte 8))
    :reader reply-stream-buffer
    :documentation "Where small writes of the body gather.")
   (buffer-end
    :initform 0 :accessor reply-stream-buffer-end :type fixnum
    :documentation "How many octets of BUFFER are written.")
   (ended-p
    :initform nil :accessor reply-stream-ended-p
    :documentation "True once the reply is ended (END-HTTP2-REPLY)."))
  (:documentation "The connection stream of an HTTP/2 stream's request: see
the top of http2-reply.lisp."))

(defun flush-http2-connection (connection)
  "Send what CONNECTION's session has made: by the caller when the
connection is parked (SERVE-OUTBOX-OUTPUT), else by its holder."
  (setf (http2-connection-flush-pending-p connection) nil)
  (offer-http2-output connection)
  ;; Parked with no deadline while handlers ran: parked again, its
  ;; deadline is the idle one once none runs.
  (serve-outbox-output connection))

(defun make-http2-reply-stream (connection stream)
  (make-instance 'http2-reply-stream :connection connection :stream stream))

(defmethod stream-element-type ((stream http2-reply-stream))
  '(unsigned-byte 8))

(defun reply-stream-session (reply)
  (http2-connection-session (reply-stream-connection reply)))

(defun read-reply-head (reply head-end)
  "Make the head in REPLY's HEAD, whole, its blank line's CR at HEAD-END,
its status and headers; a status line that names none is 500."
  (let* ((octets (reply-stream-head reply))
         (status-end (position +cr+ octets :end (1+ head-end))))
    (setf (reply-stream-status reply)
          (or (and (>= status-end 12) (parse-integer (latin-1-text octets 9 12) :junk-allowed t))
              500)
          (reply-stream-headers reply) (reply-header-fields octets (+ status-end 2) head-end)
          (reply-stream-head reply) nil)))

(defun take-head-octet (reply octet)
  "Add OCTET to REPLY's head, which is then read if it is whole."
  (let ((head (reply-stream-head reply))
        (position (reply-stream-head-end reply)))
    (when (= position (length head))
      (setf head (setf (reply-stream-head reply)
                       (replace (make-array (* 2 (length head)) :element-type '(unsigned-byte 8)) head))))
    (setf (aref head position) octet
          (reply-stream-head-end reply) (1+ position))
    (when (and (= octet +lf+) (>= position 3) (= (aref head (- position 1)) +cr+)
               (= (aref head (- position 2)) +lf+) (= (aref head (- position 3)) +cr+))
      (read-reply-head reply (- position 3)))))

(defun submit-reply-head (reply body-p)
  "Submit REPLY's HEADERS, with a body to come when BODY-P, unless they are."
  (unless (reply-stream-status reply)
    ;; Ended, or given a body, before any head: what was written was no
    ;; HTTP/1.1 reply.
    (setf (reply-stream-status reply) 500 (reply-stream-head reply) nil))
  (unless (reply-stream-submitted-p reply)
    (setf (reply-stream-submitted-p reply) t)
    (submit-http2-reply-head (reply-stream-session reply) (reply-stream-stream reply)
                             (reply-stream-status reply) (reply-stream-headers reply) body-p)))

(define-condition http2-stream-gone (stream-error)
  ()
  (:report (lambda (condition out)
             (declare (ignore condition))
             (write-string "The client reset the HTTP/2 stream, or took none of its reply for the write timeout."
                           out)))
  (:documentation "Signaled to a handler writing the reply of an HTTP/2
stream whose client reset it or stopped taking it: its writes go nowhere,
as writes to a socket its client closed."))

(defun queue-reply-body (reply octets)
  "Give OCTETS, no one's to change from now on, to REPLY's body.  False
when the stream has ended (its client reset it)."
  (submit-reply-head reply t)
  (queue-http2-reply-octets (reply-stream-session reply) (reply-stream-stream reply) octets))

(defun queue-reply-buffer (reply)
  "Give what REPLY's buffer gathered to its body.  False when the stream
has ended."
  (let ((end (shiftf (reply-stream-buffer-end reply) 0)))
    (or (zerop end)
        (queue-reply-body reply (subseq (reply-stream-buffer reply) 0 end)))))

(defun wait-for-reply-room (reply)
  "Send what REPLY's connection has to send, then wait while more than
+HTTP2-REPLY-WRITE-OCTETS+ of REPLY wait for its client, up to the write
timeout; HTTP2-STREAM-GONE when the client reset the stream or took
nothing meanwhile (the stream is then reset)."
  (let ((connection (reply-stream-connection reply))
        (stream (reply-stream-stream reply)))
    (when (> (http2-stream-reply-queued stream) +http2-reply-write-octets+)
      (flush-http2-connection connection)
      (unless (eq :room (wait-for-http2-reply-room
                         (http2-connection-session connection) stream +http2-reply-write-octets+
                         (+ (get-internal-real-time) (readiness-set-write-timeout (http2-connection-set connection)))))
        (reset-http2-stream (http2-connection-session connection) stream)
        (error 'http2-stream-gone :stream reply)))))

(defmethod trivial-gray-streams:stream-write-sequence ((reply http2-reply-stream) sequence start end &key)
  (let ((end (or end (length sequence)))
        (buffer (reply-stream-buffer reply)))
    (loop while (and (< start end) (null (reply-stream-status reply)))
          do (take-head-octet reply (aref sequence start))
             (incf start))
    (cond ((>= start end))
          ((<= (- end start) (- (length buffer) (reply-stream-buffer-end reply)))
           (replace buffer sequence :start1 (reply-stream-buffer-end reply) :start2 start :end2 end)
           (incf (reply-stream-buffer-end reply) (- end start)))
          (t (unless (and (queue-reply-buffer reply)
                          (queue-reply-body reply (subseq sequence start end)))
               (error 'http2-stream-gone :stream reply))
             (wait-for-reply-room reply)))
    sequence))

(defmethod trivial-gray-streams:stream-write-byte ((reply http2-reply-stream) byte)
  (cond ((null (reply-stream-status reply)) (take-head-octet reply byte))
        ((< (reply-stream-buffer-end reply) (length (reply-stream-buffer reply)))
         (setf (aref (reply-stream-buffer reply) (reply-stream-buffer-end reply)) byte)
         (incf (reply-stream-buffer-end reply)))
        (t (unless (queue-reply-buffer reply)
             (error 'http2-stream-gone :stream reply))
           (wait-for-reply-room reply)
           (trivial-gray-streams:stream-write-byte reply byte)))
  byte)

(defmethod trivial-gray-streams:stream-force-output ((reply http2-reply-stream))
  ;; A streamed reply's head leaves with its first force, its body with
  ;; each; a whole one's with the other streams' replies, at its end.
  (when (and (reply-stream-status reply) (not (reply-stream-ended-p reply)))
    (unless (queue-reply-buffer reply)
      (error 'http2-stream-gone :stream reply))
    (submit-reply-head reply t)
    (flush-http2-connection (reply-stream-connection reply)))
  nil)

(defmethod trivial-gray-streams:stream-finish-output ((reply http2-reply-stream))
  (trivial-gray-streams:stream-force-output reply))

(defun refuse-reply-for-memory (reply)
  "Make REPLY, its HEADERS not submitted, the engine's 503 for a memory
budget that has no room for its body."
  (multiple-value-bind (status headers body)
      (http1-reply-parts (head-error-reply 503 (readiness-set-server-name (http2-connection-set (reply-stream-connection reply)))
                                           1 "This server is short of memory for the moment.  Please try again later."))
    (setf (reply-stream-status reply) status
          (reply-stream-headers reply) headers)
    (queue-reply-body reply body)))

(defmethod write-reply-body ((body vector) file-fd (reply http2-reply-stream))
  ;; Octets given whole go to the library as they are, not copied, taken
  ;; from the memory budget if it has room for them while the head is
  ;; still to go (else the reply is 503); dropped when the client reset
  ;; the stream.
  (declare (ignore file-fd))
  (let ((octets (coerce body 'octets)))
    (cond ((zerop (length octets)) t)
          ((not (queue-reply-buffer reply)) nil)
          ((reply-stream-submitted-p reply) (queue-reply-body reply octets))
          (t (case (queue-http2-reply-octets (reply-stream-session reply) (reply-stream-stream reply) octets
                                             :reserve t)
               (:no-memory (refuse-reply-for-memory reply) nil)
               ((nil) nil)
               (t (submit-reply-head reply t) t))))))

(defun end-http2-reply (reply)
  "End REPLY once its handler has returned: its HEADERS with the stream's
end when it has no body, else the end of its body.  Its status (500 when
nothing was written)."
  (unless (reply-stream-ended-p reply)
    (setf (reply-stream-ended-p reply) t)
    (queue-reply-buffer reply)
    (if (reply-stream-submitted-p reply)
        (end-http2-reply-body (reply-stream-session reply) (reply-stream-stream reply))
        (submit-reply-head reply nil)))
  (reply-stream-status reply))
