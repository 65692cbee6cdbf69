;;;; Decoding a chunked request body (RFC 9112 7.1) with bounded memory:
;;;; whatever chunk size a client claims, the body passes through one
;;;; buffer of +CHUNK-BUFFER-BYTES+.  The framing is followed by the
;;;; CHUNK-FRAMING of chunk-framing.lisp, the same rules and limits by which
;;;; the engine refused the body as it arrived, and no trailer field name is
;;;; interned.  The reply to the request is written through the same stream,
;;;; as Hunchentoot expects of a request with a chunked body.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +chunk-buffer-bytes+ 16384
  "The octets of a chunked body read from the connection at a time.")

(defclass chunked-body-stream (refilled-chunked-stream)
  ((framing
    :initarg :framing :reader body-framing
    :documentation "The CHUNK-FRAMING the body's framing is followed by.")
   (max-body-bytes
    :initarg :max-body-bytes :reader body-max-bytes
    :documentation "The acceptor's MAX-BODY-BYTES, which the framing
enforces and REQUEST-BODY-TOO-LARGE names.")
   (trailer-line
    :initform (make-array 64 :element-type 'character :adjustable t :fill-pointer 0) :reader trailer-line
    :documentation "The characters of the trailer line being read.")
   (trailers
    :initform '() :accessor body-trailers
    :documentation "The trailer fields read so far whose names are
keywords already, the last first.")
   (framing-complete-p
    :initform nil :accessor framing-complete-p
    :documentation "True once the body's last octet has been read, while
the chunk buffer may still hold data: the next refill ends the body.")
   (finished-p
    :initform nil :accessor body-finished-p
    :documentation "True once the last chunk and the trailer section have
been read: the connection's next octets begin the next request.")
   (failure
    :initform nil :accessor body-failure
    :documentation "The condition the body was refused with, or NIL.
Every read after that signals it again: the body's end can no longer be
found.")
   (reply-started-p
    :initform nil :accessor reply-started-p
    :documentation "True once an octet of the reply has been written."))
  (:documentation "The stream a chunked request body is read from and the
reply to that request written to.  Signals CHUNKED-BODY-MALFORMED for a
body that breaks RFC 9112's chunked coding or the limits of
chunk-framing.lisp, REQUEST-BODY-TOO-LARGE for chunks beyond
MAX-BODY-BYTES, and CHUNGA:INPUT-CHUNKING-UNEXPECTED-END-OF-FILE when the
client closes before the body's end.  CHUNGA:CHUNKED-INPUT-STREAM-TRAILERS
holds the trailer fields whose names are already keywords; the others are
dropped, since interning them would let a client grow the keyword package
at will."))

(defun unanswered-body-refusal (content-stream chunked-p)
  "The status the request is to be answered, when its body, read from
CONTENT-STREAM (chunked when CHUNKED-P), was refused and no octet of the
reply has been written: 413 for a body over the limit, 400 for a malformed
one.  NIL otherwise."
  (let ((failure (and chunked-p (body-failure content-stream))))
    (when (and failure (not (reply-started-p content-stream)))
      (if (typep failure 'request-body-too-large) 413 400))))

(defun make-chunked-body-stream (stream max-body-bytes)
  "A CHUNKED-BODY-STREAM decoding the body from STREAM, a bidirectional
binary stream, of at most MAX-BODY-BYTES octets (NIL: no limit)."
  (let ((chunked (make-instance 'chunked-body-stream :real-stream stream
                                                     :framing (make-chunk-framing max-body-bytes)
                                                     :max-body-bytes max-body-bytes)))
    (setf (chunga:chunked-stream-input-chunking-p chunked) t
          (chunk-buffer chunked) (make-array +chunk-buffer-bytes+ :element-type '(unsigned-byte 8)))
    chunked))

(defun refuse-body (stream condition)
  (error (setf (body-failure stream) condition)))

(defmethod trivial-gray-streams:stream-write-byte :before ((stream chunked-body-stream) octet)
  (declare (ignore octet))
  (setf (reply-started-p stream) t))

(defmethod trivial-gray-streams:stream-write-sequence :before ((stream chunked-body-stream) sequence start end
                                                             &key)
  (declare (ignore sequence start end))
  (setf (reply-started-p stream) t))

(defun read-body-octet (stream inner)
  (or (read-byte inner nil)
      (error 'chunga:input-chunking-unexpected-end-of-file :stream stream)))

(defun trailer-field (line)
  "The (keyword . value) pair of the trailer field LINE when its name is
already a keyword, else NIL."
  (let ((colon (position #\: line)))
    (when colon
      (let ((name (find-symbol (string-upcase (subseq line 0 colon)) :keyword)))
        (when name
          (cons name (string-trim '(#\Space #\Tab) (subseq line (1+ colon)))))))))

(defun keep-trailer-octet (stream state octet)
  "OCTET of the framing was followed from STATE: keep it when it belongs to
a trailer line, and keep the field of a line it ended."
  (case state
    (:trailer
     (unless (= octet +cr+)
       (vector-push-extend (code-char octet) (trailer-line stream))))
    (:trailer-lf
     (let ((field (trailer-field (trailer-line stream))))
       (when field
         (push field (body-trailers stream))))
     (setf (fill-pointer (trailer-line stream)) 0))))

(defun read-framing-octet (stream inner framing)
  "Read the next octet of the body's framing from INNER and follow FRAMING
through it.  True when it was the body's last octet; a refused body is
signalled."
  (let* ((state (chunk-framing-state framing))
         (octet (read-body-octet stream inner)))
    (multiple-value-bind (outcome reason) (advance-chunk-framing framing octet)
      (case outcome
        ((nil) (when (member state '(:trailer :trailer-lf))
                 (keep-trailer-octet stream state octet))
         nil)
        (:complete t)
        (413 (refuse-body stream (make-condition 'request-body-too-large :stream stream
                                                                         :limit (body-max-bytes stream))))
        (t (refuse-body stream (make-condition 'chunked-body-malformed :stream stream :reason reason)))))))

(defun read-chunk-data (stream inner buffer start end)
  "Read the octets of BUFFER from START below END from INNER; one octet by
itself, the commonest piece of a body sent in tiny chunks."
  (if (= end (1+ start))
      (setf (aref buffer start) (read-body-octet stream inner))
      (when (< (read-sequence buffer inner :start start :end end) end)
        (error 'chunga:input-chunking-unexpected-end-of-file :stream stream))))

(defun end-chunked-body (stream)
  "The body's last octet has been read and its data handed out: keep its
trailers and turn chunking off, so that STREAM reads its inner stream's
next octets unchanged."
  (setf (chunk-trailers stream) (reverse (body-trailers stream))
        (chunk-buffer-index stream) 0
        (chunk-buffer-limit stream) 0
        (chunga:chunked-stream-input-chunking-p stream) nil
        (body-finished-p stream) t)
  nil)

(defmethod refill-chunk-buffer ((stream chunked-body-stream))
  "Fill the chunk buffer with as many chunks' data as it takes: the engine
hands a handler only a body that has arrived whole, so reading on past a
chunk never waits, and a body of tiny chunks costs one refill per buffer,
not per chunk.  The refill after the body's last octet ends it."
  (let ((inner (chunga:chunked-stream-stream stream))
        (buffer (chunk-buffer stream))
        (framing (body-framing stream))
        (count 0))
    (declare (type fixnum count) (type octets buffer))
    (when (body-failure stream)
      (error (body-failure stream)))
    (unless (framing-complete-p stream)
      (loop while (< count (length buffer))
            do (if (chunk-data-follows-p framing)
                   (let ((wanted (min (chunk-framing-size framing) (- (length buffer) count))))
                     (read-chunk-data stream inner buffer count (+ count wanted))
                     (take-chunk-data framing wanted)
                     (incf count wanted))
                   (when (read-framing-octet stream inner framing)
                     (setf (framing-complete-p stream) t)
                     (return)))))
    (if (zerop count)
        (end-chunked-body stream)
        (progn (setf (chunk-buffer-index stream) 0
                     (chunk-buffer-limit stream) count)
               count))))
