;;;; The reply to an HTTP/2 stream as its handler writes it: the stream its
;;;; request's connection stream is, to which the engine and Hunchentoot
;;;; write the reply as on HTTP/1.1 -- a status line, header lines, a blank
;;;; line, the body, never chunked (Hunchentoot chunks HTTP/1.1 only).  The
;;;; head is read back into HEADERS (RFC 9113 8.3.2: a status pseudo-header,
;;;; the connection's own headers left out); the body goes to the library
;;;; as it is written (QUEUE-HTTP2-REPLY-OCTETS), and leaves as DATA frames
;;;; as flow control lets it: at each FORCE-OUTPUT for a handler streaming
;;;; through SEND-HEADERS, with the other streams' replies for a body given
;;;; whole.  A body the engine gives whole (WRITE-REPLY-BODY) is queued as
;;;; it is; one written piece by piece is copied, and its writer waits while
;;;; more than +HTTP2-REPLY-WRITE-OCTETS+ of it wait for the client, as a
;;;; writer on HTTP/1.1 waits for its socket.
;;;;
;;;; The gray stream carries an HTTP2-REPLY, a structure: its state is read
;;;; and written at every octet of the head, where a class's accessors, each
;;;; a generic call, cost a stream a third of its time.  A reply stream is
;;;; written by the one worker running its stream's handler.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +http2-reply-write-octets+ (* 256 1024)
  "The octets of a reply written piece by piece that may wait for its
client before its writer waits for room.")

(defconstant +http2-reply-buffer-octets+ 4096
  "The buffer in which a reply's small writes gather before they are given
to the library as one piece.")

(defstruct (http2-reply (:constructor make-http2-reply (connection stream)))
  "What the reply of an HTTP/2 stream has been written so far."
  ;; The HTTP2-CONNECTION and the HTTP2-STREAM answered.
  (connection nil :read-only t)
  (stream nil :read-only t)
  ;; The octets of the head written so far, and how many, until it is
  ;; whole; then HEAD is NIL.
  (head (make-array 512 :element-type '(unsigned-byte 8)) :type (or null octets))
  (head-end 0 :type fixnum)
  ;; Its status and header fields (an alist of lower-case names and
  ;; values) once the head is whole; the status is NIL before.
  (status nil)
  (headers '())
  ;; True once its HEADERS are submitted to the library.
  (submitted-p nil)
  ;; The body the engine gave whole, kept to be submitted with the head
  ;; in one hold of the session's lock, or NIL.
  (whole-body nil :type (or null octets))
  ;; Where small writes of the body gather, made at the first, and how
  ;; many octets it holds.
  (buffer nil :type (or null octets))
  (buffer-end 0 :type fixnum)
  ;; True once the reply is ended (END-HTTP2-REPLY).
  (ended-p nil))

(defclass http2-reply-stream (trivial-gray-streams:fundamental-binary-output-stream)
  ((reply
    :initarg :reply :reader reply-stream-reply :type http2-reply
    :documentation "The HTTP2-REPLY written through this stream."))
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
  (make-instance 'http2-reply-stream :reply (make-http2-reply connection stream)))

(defun http2-reply-stream-p (object)
  (typep object 'http2-reply-stream))

(defmethod stream-element-type ((stream http2-reply-stream))
  '(unsigned-byte 8))

(defun http2-reply-session (reply)
  (http2-connection-session (http2-reply-connection reply)))

(defun read-reply-head (reply head-end)
  "Make the head in REPLY's HEAD, whole, its blank line's CR at HEAD-END,
its status and headers; a status line that names none is 500."
  (let* ((octets (http2-reply-head reply))
         (status-end (position +cr+ octets :end (1+ head-end))))
    (setf (http2-reply-status reply)
          (or (and (>= status-end 12) (parse-integer (latin-1-text octets 9 12) :junk-allowed t))
              500)
          (http2-reply-headers reply) (reply-header-fields octets (+ status-end 2) head-end)
          (http2-reply-head reply) nil)))

(defun take-head-octets (reply sequence start end)
  "Add the octets of SEQUENCE from START below END to REPLY's head, read
once whole (READ-REPLY-HEAD): where the body's octets start among them,
or END when none did."
  (declare (type fixnum start end))
  (let* ((old-end (http2-reply-head-end reply))
         (new-end (+ old-end (- end start)))
         (head (http2-reply-head reply)))
    (declare (type fixnum old-end new-end))
    (when (> new-end (length head))
      (setf head (setf (http2-reply-head reply)
                       (replace (make-array (max new-end (* 2 (length head))) :element-type '(unsigned-byte 8))
                                head :end2 old-end))))
    (replace head sequence :start1 old-end :start2 start :end2 end)
    (setf (http2-reply-head-end reply) new-end)
    (let ((blank (loop for index of-type fixnum from (max 0 (- old-end 3)) below (- new-end 3)
                       when (and (= (aref head index) +cr+) (= (aref head (+ index 1)) +lf+)
                                 (= (aref head (+ index 2)) +cr+) (= (aref head (+ index 3)) +lf+))
                         return index)))
      (if blank
          (progn (read-reply-head reply blank)
                 (+ start (- (+ blank 4) old-end)))
          end))))

(defun submit-reply-head (reply body-p)
  "Submit REPLY's HEADERS, with a body to come when BODY-P, unless they are."
  (unless (http2-reply-status reply)
    ;; Ended, or given a body, before any head: what was written was no
    ;; HTTP/1.1 reply.
    (setf (http2-reply-status reply) 500 (http2-reply-head reply) nil))
  (unless (http2-reply-submitted-p reply)
    (setf (http2-reply-submitted-p reply) t)
    (submit-http2-reply-head (http2-reply-session reply) (http2-reply-stream reply)
                             (http2-reply-status reply) (http2-reply-headers reply) body-p)))

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
  (queue-http2-reply-octets (http2-reply-session reply) (http2-reply-stream reply) octets))

(defun submit-whole-reply (reply)
  "Submit REPLY, its head not submitted, whole: its head and WHOLE-BODY,
taken from the memory budget if it has room for it, else the engine's 503
for want of memory."
  (setf (http2-reply-submitted-p reply) t)
  (when (eq :no-memory
            (submit-http2-whole-reply (http2-reply-session reply) (http2-reply-stream reply)
                                      (or (http2-reply-status reply) 500) (http2-reply-headers reply)
                                      (shiftf (http2-reply-whole-body reply) nil) :reserve t))
    (multiple-value-bind (status headers body)
        (http1-reply-parts (head-error-reply 503 (readiness-set-server-name
                                                  (http2-connection-set (http2-reply-connection reply)))
                                             1 "This server is short of memory for the moment.  Please try again later."))
      (setf (http2-reply-status reply) status)
      (submit-http2-whole-reply (http2-reply-session reply) (http2-reply-stream reply) status headers body))))

(defun queue-reply-buffer (reply)
  "Give what REPLY's buffer gathered, and a body given whole before it, to
its body.  False when the stream has ended."
  (when (http2-reply-whole-body reply)
    ;; More is written after it: it goes first, as any piece.
    (unless (queue-reply-body reply (shiftf (http2-reply-whole-body reply) nil))
      (return-from queue-reply-buffer nil)))
  (let ((end (shiftf (http2-reply-buffer-end reply) 0)))
    (or (zerop end)
        (queue-reply-body reply (subseq (http2-reply-buffer reply) 0 end)))))

(defun wait-for-reply-room (stream reply)
  "Send what REPLY's connection has to send, then wait while more than
+HTTP2-REPLY-WRITE-OCTETS+ of REPLY wait for its client, up to the write
timeout; HTTP2-STREAM-GONE on STREAM, REPLY's gray stream, when the client
reset the stream or took nothing meanwhile (the stream is then reset)."
  (let ((connection (http2-reply-connection reply))
        (http2-stream (http2-reply-stream reply)))
    (when (> (http2-stream-reply-queued http2-stream) +http2-reply-write-octets+)
      (flush-http2-connection connection)
      (unless (eq :room (wait-for-http2-reply-room
                         (http2-connection-session connection) http2-stream +http2-reply-write-octets+
                         (+ (get-internal-real-time) (readiness-set-write-timeout (http2-connection-set connection)))))
        (reset-http2-stream (http2-connection-session connection) http2-stream)
        (error 'http2-stream-gone :stream stream)))))

(defun reply-buffer-room (reply)
  "REPLY's buffer, made at the first small write, and the room left in it."
  (let ((buffer (or (http2-reply-buffer reply)
                    (setf (http2-reply-buffer reply)
                          (make-array +http2-reply-buffer-octets+ :element-type '(unsigned-byte 8))))))
    (values buffer (- (length buffer) (http2-reply-buffer-end reply)))))

(defmethod trivial-gray-streams:stream-write-sequence ((stream http2-reply-stream) sequence start end &key)
  (let* ((reply (reply-stream-reply stream))
         (end (or end (length sequence)))
         (start (if (http2-reply-status reply) start (take-head-octets reply sequence start end))))
    (when (< start end)
      (multiple-value-bind (buffer room) (reply-buffer-room reply)
        (if (<= (- end start) room)
            (progn (replace buffer sequence :start1 (http2-reply-buffer-end reply) :start2 start :end2 end)
                   (incf (http2-reply-buffer-end reply) (- end start)))
            (progn (unless (and (queue-reply-buffer reply)
                                (queue-reply-body reply (subseq sequence start end)))
                     (error 'http2-stream-gone :stream stream))
                   (wait-for-reply-room stream reply)))))
    sequence))

(defmethod trivial-gray-streams:stream-write-byte ((stream http2-reply-stream) byte)
  (let ((octet (make-array 1 :element-type '(unsigned-byte 8) :initial-element byte)))
    (declare (dynamic-extent octet))
    (trivial-gray-streams:stream-write-sequence stream octet 0 1)
    byte))

(defmethod trivial-gray-streams:stream-force-output ((stream http2-reply-stream))
  ;; A streamed reply's head leaves with its first force, its body with
  ;; each; a whole one's with the other streams' replies, at its end.
  (let ((reply (reply-stream-reply stream)))
    (when (and (http2-reply-status reply) (not (http2-reply-ended-p reply)))
      (unless (queue-reply-buffer reply)
        (error 'http2-stream-gone :stream stream))
      (submit-reply-head reply t)
      (flush-http2-connection (http2-reply-connection reply))))
  nil)

(defmethod trivial-gray-streams:stream-finish-output ((stream http2-reply-stream))
  (trivial-gray-streams:stream-force-output stream))

(defmethod write-reply-body ((body vector) file-fd (stream http2-reply-stream))
  ;; Octets given whole go to the library as they are, not copied; kept,
  ;; while nothing else is written, to go with the head at the reply's end
  ;; (SUBMIT-WHOLE-REPLY); dropped when the client reset the stream.
  (declare (ignore file-fd))
  (let ((reply (reply-stream-reply stream))
        (octets (coerce body 'octets)))
    (cond ((zerop (length octets)) t)
          ((or (http2-reply-submitted-p reply) (http2-reply-whole-body reply)
               (plusp (http2-reply-buffer-end reply)))
           (and (queue-reply-buffer reply) (queue-reply-body reply octets)))
          (t (setf (http2-reply-whole-body reply) octets)
             t))))

(defun http2-reply-stream-status (stream)
  "The status of the reply written to STREAM so far (500 when none)."
  (or (http2-reply-status (reply-stream-reply stream)) 500))

(defun end-http2-reply (stream)
  "End the reply written to STREAM once its handler has returned: its
HEADERS with the stream's end when it has no body, else the end of its
body.  Its status (500 when nothing was written)."
  (let ((reply (reply-stream-reply stream)))
    (unless (http2-reply-ended-p reply)
      (setf (http2-reply-ended-p reply) t)
      (cond ((and (not (http2-reply-submitted-p reply)) (zerop (http2-reply-buffer-end reply)))
             (submit-whole-reply reply))
            (t (queue-reply-buffer reply)
               (end-http2-reply-body (http2-reply-session reply) (http2-reply-stream reply)))))
    (or (http2-reply-status reply) 500)))

;;; A reply its handler deferred (src/deferred-replies.lisp): the stream
;;; stays open without a worker, its connection parked with no deadline of
;;; its own (HTTP2-DEADLINE), until a worker sends the reply.

(defun make-http2-deferred-reply (set reply-stream acceptor request reply session timeout timeout-status
                                  on-client-gone time-out)
  "Make the reply to REQUEST, written to REPLY-STREAM (an HTTP2-REPLY-STREAM), a
DEFERRED-REPLY whose timer calls TIME-OUT, a function of it, after TIMEOUT
seconds; returns it.  Its stream stays open, with no worker, until it is
settled; it is counted among SET's deferred replies and its connection's
held ones until ENDED-HTTP2-DEFERRED-REPLY."
  (atomic-increment (readiness-set-deferred-count set))
  (atomic-increment (http2-connection-held (http2-reply-connection (reply-stream-reply reply-stream))))
  (let ((deferred (%make-deferred-reply :http2-reply reply-stream :set set :acceptor acceptor
                                        :request request :reply reply :session session
                                        :deadline (+ (get-internal-real-time) (seconds->internal-units timeout))
                                        :timeout-status timeout-status :on-client-gone on-client-gone
                                        :deferred-at (monotonic-microseconds))))
    (setf (deferred-reply-timer deferred)
          (schedule-timer (readiness-set-timers set) (* 1000 timeout) (lambda () (funcall time-out deferred))))
    deferred))

(defun ended-http2-deferred-reply (deferred)
  "DEFERRED, an HTTP/2 stream's, has been answered or given up: its timer
cancelled, no more counted among its set's deferred replies and its
connection's held ones.  Called once."
  (cancel-timer (deferred-reply-timer deferred))
  (atomic-decrement (http2-connection-held (http2-reply-connection
                                            (reply-stream-reply (deferred-reply-http2-reply deferred)))))
  (atomic-decrement (readiness-set-deferred-count (deferred-reply-set deferred))))
