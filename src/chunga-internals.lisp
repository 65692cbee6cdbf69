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
