;;;; Decoding a chunked request body (RFC 9112 7.1) with bounded memory:
;;;; whatever chunk size a client claims, the body passes through one
;;;; buffer of +CHUNK-BUFFER-BYTES+; chunk-size lines and the trailer
;;;; section are bounded by the limits of chunk-framing.lisp; and no trailer
;;;; field name is interned.  The reply to the request is written through
;;;; the same stream, as Hunchentoot expects of a request with a chunked
;;;; body.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +chunk-buffer-bytes+ 16384
  "The octets of a chunked body read from the connection at a time.")

(defclass chunked-body-stream (refilled-chunked-stream)
  ((chunk-remaining
    :initform 0 :accessor chunk-remaining
    :documentation "Octets of the current chunk's data not read yet.")
   (expecting-crlf-p
    :initform nil :accessor expecting-crlf-p
    :documentation "True when the CRLF that ends a chunk's data comes next.")
   (last-chunk-read-p
    :initform nil :accessor last-chunk-read-p
    :documentation "True once the last chunk's size line has been read
after data the buffer still holds: the next refill reads the trailers.")
   (finished-p
    :initform nil :accessor body-finished-p
    :documentation "True once the last chunk and the trailer section have
been read: the connection's next octets begin the next request.")
   (failure
    :initform nil :accessor body-failure
    :documentation "The condition the body was refused with, or NIL.
Every read after that signals it again: the body's end can no longer be
found.")
   (octets-left
    :initarg :octets-left :accessor body-octets-left
    :documentation "How many more octets of chunk data the acceptor's
MAX-BODY-BYTES allows, or NIL for no limit.")
   (reply-started-p
    :initform nil :accessor reply-started-p
    :documentation "True once an octet of the reply has been written."))
  (:documentation "The stream a chunked request body is read from and the
reply to that request written to.  Signals CHUNKED-BODY-MALFORMED for a
body that breaks RFC 9112's chunked coding or the limits above, and
CHUNGA:INPUT-CHUNKING-UNEXPECTED-END-OF-FILE when the client closes before
the body's end.  CHUNGA:CHUNKED-INPUT-STREAM-TRAILERS holds the trailer
fields whose names are already keywords; the others are dropped, since
interning them would let a client grow the keyword package at will."))

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
  (let ((chunked (make-instance 'chunked-body-stream :real-stream stream :octets-left max-body-bytes)))
    (setf (chunga:chunked-stream-input-chunking-p chunked) t
          (chunk-buffer chunked) (make-array +chunk-buffer-bytes+ :element-type '(unsigned-byte 8)))
    chunked))

(defun refuse-body (stream condition)
  (error (setf (body-failure stream) condition)))

(defun malformed-body (stream reason &rest arguments)
  (refuse-body stream (make-condition 'chunked-body-malformed
                                      :stream stream :reason (apply #'format nil reason arguments))))

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

(defun read-body-line (stream inner limit what)
  "The octets of the next line of INNER, up to its CRLF (excluded), as a
string of Latin-1 characters; at most LIMIT octets."
  (let ((line (make-array 64 :element-type 'character :adjustable t :fill-pointer 0)))
    (loop for octet = (read-body-octet stream inner)
          do (cond ((= octet +cr+)
                    (unless (= (read-body-octet stream inner) +lf+)
                      (malformed-body stream "~A: CR not followed by LF" what))
                    (return line))
                   ((= octet +lf+)
                    (malformed-body stream "~A ends with a bare LF" what))
                   ((>= (length line) limit)
                    (malformed-body stream "~A longer than ~D octets" what limit))
                   (t (vector-push-extend (code-char octet) line))))))

(defun read-chunk-size (stream inner)
  "Read the next chunk-size line of INNER, up to its CRLF, octet by octet
and without making a string of it: a body of one-octet chunks has one per
octet.  Returns the size; chunk extensions after it are ignored, as RFC
9112 allows, but count towards +MAX-CHUNK-LINE-BYTES+."
  (let ((size 0)
        (digits 0)
        (line-octets 0))
    (declare (type fixnum digits line-octets) (type (integer 0) size))
    (flet ((line-end (octet)
             ;; OCTET is a CR or a LF: the line ends here, or is malformed.
             (if (and (= octet +cr+) (= (read-body-octet stream inner) +lf+))
                 (return-from read-chunk-size size)
                 (malformed-body stream "a chunk-size line ~:[ends with a bare LF~;has a CR not followed by LF~]"
                                 (= octet +cr+))))
           (count-octet ()
             (when (> (incf line-octets) +max-chunk-line-bytes+)
               (malformed-body stream "a chunk-size line longer than ~D octets" +max-chunk-line-bytes+))))
      (loop for octet = (read-body-octet stream inner)
            for digit = (and (< octet 128) (digit-char-p (code-char octet) 16))
            while digit
            do (when (> (incf digits) +max-chunk-size-digits+)
                 (malformed-body stream "chunk size of more than ~D hexadecimal digits" +max-chunk-size-digits+))
               (count-octet)
               (setf size (+ (* 16 size) digit))
            finally (cond ((zerop digits) (malformed-body stream "chunk-size line without a size"))
                          ((or (= octet +cr+) (= octet +lf+)) (line-end octet))
                          ((not (member octet '(59 32 9))) ; ; SP HT
                           (malformed-body stream "chunk size followed by ~S" (code-char octet)))))
      ;; Extensions: skipped to the line's end.
      (loop (let ((octet (read-body-octet stream inner)))
              (if (or (= octet +cr+) (= octet +lf+))
                  (line-end octet)
                  (count-octet)))))))

(defun trailer-field (line)
  "The (keyword . value) pair of the trailer field LINE when its name is
already a keyword, else NIL."
  (let ((colon (position #\: line)))
    (when colon
      (let ((name (find-symbol (string-upcase (subseq line 0 colon)) :keyword)))
        (when name
          (cons name (string-trim '(#\Space #\Tab) (subseq line (1+ colon)))))))))

(defun read-trailer-section (stream inner)
  "Read the trailer section ending a chunked body, up to its empty line; the
fields whose names are keywords already."
  (loop with budget = +max-trailer-bytes+
        for line = (read-body-line stream inner budget "the trailer section")
        until (zerop (length line))
        do (decf budget (+ 2 (length line)))
           (when (minusp budget)
             (malformed-body stream "trailer section longer than ~D octets" +max-trailer-bytes+))
        when (trailer-field line)
          collect it))

(defun end-chunked-body (stream inner)
  "The last chunk has been read: read the trailer section and turn chunking
off, so that STREAM reads INNER's next octets unchanged."
  (setf (chunk-trailers stream) (read-trailer-section stream inner)
        (chunk-buffer-index stream) 0
        (chunk-buffer-limit stream) 0
        (chunga:chunked-stream-input-chunking-p stream) nil
        (body-finished-p stream) t)
  nil)

(defun read-chunk-data (stream inner buffer start end)
  "Read the octets of BUFFER from START below END from INNER; one octet by
itself, the commonest piece of a body sent in tiny chunks."
  (if (= end (1+ start))
      (setf (aref buffer start) (read-body-octet stream inner))
      (when (< (read-sequence buffer inner :start start :end end) end)
        (error 'chunga:input-chunking-unexpected-end-of-file :stream stream))))

(defmethod refill-chunk-buffer ((stream chunked-body-stream))
  "Fill the chunk buffer with as many chunks' data as it takes: the engine
hands a handler only a body that has arrived whole, so reading on past a
chunk never waits, and a body of tiny chunks costs one refill per buffer,
not per chunk.  The last chunk ends the body at the next refill."
  (let ((inner (chunga:chunked-stream-stream stream))
        (buffer (chunk-buffer stream))
        (count 0)
        (remaining (chunk-remaining stream)))
    (declare (type fixnum count) (type (integer 0) remaining) (type octets buffer))
    (when (body-failure stream)
      (error (body-failure stream)))
    (when (last-chunk-read-p stream)
      (return-from refill-chunk-buffer (end-chunked-body stream inner)))
    (loop
      (when (zerop remaining)
        (when (expecting-crlf-p stream)
          (unless (and (= (read-body-octet stream inner) +cr+) (= (read-body-octet stream inner) +lf+))
            (malformed-body stream "chunk data not followed by CRLF"))
          (setf (expecting-crlf-p stream) nil))
        (let ((size (read-chunk-size stream inner)))
          (when (zerop size)
            (when (zerop count)
              (return-from refill-chunk-buffer (end-chunked-body stream inner)))
            (setf (last-chunk-read-p stream) t)
            (return))
          (let ((left (body-octets-left stream)))
            (when left
              (when (> size left)
                (refuse-body stream (make-condition 'request-body-too-large :stream stream :limit
                                                    (acceptor-max-body-bytes hunchentoot:*acceptor*))))
              (setf (body-octets-left stream) (- left size))))
          (setf remaining size)))
      (let ((wanted (min remaining (- (length buffer) count))))
        (read-chunk-data stream inner buffer count (+ count wanted))
        (incf count wanted)
        (decf remaining wanted)
        (when (zerop remaining)
          (setf (expecting-crlf-p stream) t))
        (when (= count (length buffer))
          (return))))
    (setf (chunk-remaining stream) remaining
          (chunk-buffer-index stream) 0
          (chunk-buffer-limit stream) count)
    count))
