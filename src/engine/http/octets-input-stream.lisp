;;;; A binary input stream over octets already in memory: the content
;;;; stream of a request body that has arrived whole, in the worker's buffer
;;;; with its head or gathered by the engine while it arrived.  Hunchentoot's
;;;; RAW-POST-DATA reads it with one READ-SEQUENCE, its multipart parser and
;;;; a handler's flexi-stream byte by byte.  FLEXI-STREAMS' in-memory stream
;;;; copied a body octet by octet through generic accessors: 6% of the
;;;; server's time for a POST form of three fields
;;;; (bench/profiles/2026-11-27-application-sessions.txt, item 6); here
;;;; READ-SEQUENCE is one REPLACE.

(in-package #:hunchentoot-recycling-taskmaster)

(defclass octets-input-stream (trivial-gray-streams:fundamental-binary-input-stream)
  ((octets
    :initarg :octets :reader stream-octets :type octets
    :documentation "The vector the stream's octets are in; the stream
reads those from START below END, and never writes to it.")
   (start
    :initarg :start :reader stream-start :type fixnum
    :documentation "Where the stream's first octet is in OCTETS.")
   (index
    :initarg :start :accessor stream-index :type fixnum
    :documentation "Where the next octet read is in OCTETS.")
   (end
    :initarg :end :reader stream-end :type fixnum
    :documentation "Where the stream's octets end in OCTETS: reading
there meets the end of file."))
  (:documentation "A binary input stream of the octets of a vector from
START below END.  FILE-POSITION counts from START; LISTEN is true while
an octet is left."))

(defun make-octets-input-stream (octets &key (start 0) (end (length octets)))
  "A stream of the octets of the simple octet vector OCTETS from START
below END, which the stream's reader must not see change."
  (make-instance 'octets-input-stream :octets octets :start start :end end))

(defmethod stream-element-type ((stream octets-input-stream))
  '(unsigned-byte 8))

(defmethod trivial-gray-streams:stream-read-byte ((stream octets-input-stream))
  (let ((index (stream-index stream)))
    (if (< index (stream-end stream))
        (prog1 (aref (stream-octets stream) index)
          (setf (stream-index stream) (1+ index)))
        :eof)))

(defmethod trivial-gray-streams:stream-read-sequence ((stream octets-input-stream) sequence start end &key)
  "Copy the stream's next octets into SEQUENCE from START below END, as
many as are left: the index in SEQUENCE after the last one copied."
  (let* ((end (or end (length sequence)))
         (index (stream-index stream))
         (count (min (- end start) (- (stream-end stream) index))))
    (replace sequence (stream-octets stream) :start1 start :end1 (+ start count) :start2 index)
    (setf (stream-index stream) (+ index count))
    (+ start count)))

(defmethod trivial-gray-streams:stream-listen ((stream octets-input-stream))
  (< (stream-index stream) (stream-end stream)))

(defmethod trivial-gray-streams:stream-file-position ((stream octets-input-stream))
  (- (stream-index stream) (stream-start stream)))

(defmethod (setf trivial-gray-streams:stream-file-position) (position (stream octets-input-stream))
  "Move to POSITION (:START, :END, or a count of octets from the start):
true when it is within the stream's octets, else false and the stream
unmoved."
  (let ((index (case position
                 (:start (stream-start stream))
                 (:end (stream-end stream))
                 (t (and (typep position '(integer 0)) (+ (stream-start stream) position))))))
    (when (and index (<= index (stream-end stream)))
      (setf (stream-index stream) index)
      t)))
