;;;; Every use of a symbol that Chunga 1.1 does not export lives in this
;;;; file, so that the next Chunga breaks in one place.  Hunchentoot tells a
;;;; chunked request body by the type of its stream, CHUNGA:CHUNKED-STREAM,
;;;; so the engine's decoder is one, with its own way of filling the chunk
;;;; buffer: Chunga's allocates a buffer as large as the chunk size the
;;;; client claims, and interns every trailer field name.

(in-package #:hunchentoot-recycling-taskmaster)

(defclass refilled-chunked-stream (chunga:chunked-io-stream)
  ()
  (:documentation "A Chunga chunked stream whose chunk buffer
REFILL-CHUNK-BUFFER fills, instead of Chunga's own reader."))

(defgeneric refill-chunk-buffer (stream)
  (:documentation "Fill STREAM's chunk buffer (CHUNK-BUFFER) with the next
octets of the body, setting CHUNK-BUFFER-INDEX to 0 and CHUNK-BUFFER-LIMIT
to their count; return the count, or NIL once the body has ended."))

(defmethod chunga::fill-buffer ((stream refilled-chunked-stream))
  (refill-chunk-buffer stream))

(defun chunk-buffer (stream)
  (slot-value stream 'chunga::input-buffer))

(defun (setf chunk-buffer) (buffer stream)
  (setf (slot-value stream 'chunga::input-buffer) buffer))

(defun (setf chunk-buffer-index) (index stream)
  (setf (chunga::chunked-stream-input-index stream) index))

(defun (setf chunk-buffer-limit) (limit stream)
  (setf (chunga::chunked-stream-input-limit stream) limit))

(defun (setf chunk-trailers) (trailers stream)
  "Set what CHUNGA:CHUNKED-INPUT-STREAM-TRAILERS returns."
  (setf (slot-value stream 'chunga::chunk-trailers) trailers))

;;; A chunked reply whose data are coded as they are written.

(defclass filtered-chunked-stream (chunga:chunked-io-stream)
  ((filter :initarg :filter :reader chunk-filter
           :documentation "A function of octets, a start, an end and :MORE,
:FLUSH or :FINISH, returning the octets to send for them (maybe none): what
the data written so far have become, everything when :FLUSH (a
FORCE-OUTPUT), the rest when :FINISH (the body ends)."))
  (:documentation "A Chunga chunked stream whose chunks carry what FILTER
makes of the data written to it: a reply coded as the handler writes it."))

(defun make-filtered-chunked-stream (stream filter)
  "A FILTERED-CHUNKED-STREAM over STREAM with FILTER, its chunking off."
  (make-instance 'filtered-chunked-stream :real-stream stream :filter filter))

(defun write-chunk-frame (stream octets)
  "Write OCTETS, when there are any, as one chunk to STREAM's real stream
(never an empty chunk, which would end the body)."
  (when (plusp (length octets))
    (let ((real (chunga:chunked-stream-stream stream)))
      (write-sequence (map '(vector (unsigned-byte 8)) #'char-code (format nil "~X" (length octets))) real)
      (write-byte 13 real) (write-byte 10 real)
      (write-sequence octets real)
      (write-byte 13 real) (write-byte 10 real))))

(defun write-filtered-rest (stream mode)
  "Send, when STREAM's chunking is on, its buffer and then what its filter
holds, as MODE (:FLUSH or :FINISH) asks."
  (when (chunga:chunked-stream-output-chunking-p stream)
    (chunga::flush-buffer stream)
    (write-chunk-frame stream (funcall (chunk-filter stream) (make-array 0 :element-type '(unsigned-byte 8)) 0 0 mode))))

(defmethod chunga::write-chunk ((stream filtered-chunked-stream) sequence &key (start 0) (end (length sequence)))
  (if (typep sequence '(simple-array (unsigned-byte 8) (*)))
      (write-chunk-frame stream (funcall (chunk-filter stream) sequence start end :more))
      (let ((octets (coerce (subseq sequence start end) '(simple-array (unsigned-byte 8) (*)))))
        (write-chunk-frame stream (funcall (chunk-filter stream) octets 0 (length octets) :more)))))

(defmethod trivial-gray-streams:stream-force-output ((stream filtered-chunked-stream))
  (write-filtered-rest stream :flush)
  (force-output (chunga:chunked-stream-stream stream)))

(defmethod trivial-gray-streams:stream-finish-output ((stream filtered-chunked-stream))
  (write-filtered-rest stream :flush)
  (finish-output (chunga:chunked-stream-stream stream)))

(defmethod (setf chunga:chunked-stream-output-chunking-p) :before (new-value (stream filtered-chunked-stream))
  (unless new-value
    (write-filtered-rest stream :finish)))
