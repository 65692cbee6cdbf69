;;;; A binary output stream into octets in memory: where the reply to an
;;;; HTTP/2 stream is written, by the engine or by Hunchentoot, as it would
;;;; be to an HTTP/1.1 connection.  FLEXI-STREAMS' in-memory output stream
;;;; took a tenth of an HTTP/2 request's time, a generic access an octet
;;;; (bench/profiles/2026-11-28-http2.txt); here WRITE-SEQUENCE is one
;;;; REPLACE.

(in-package #:hunchentoot-recycling-taskmaster)

(defclass octets-output-stream (trivial-gray-streams:fundamental-binary-output-stream)
  ((octets
    :initform (make-array 1024 :element-type '(unsigned-byte 8)) :accessor stream-octets :type octets
    :documentation "The vector written into, replaced by one twice as long when full.")
   (end
    :initform 0 :accessor stream-end :type fixnum
    :documentation "How many octets have been written: they start OCTETS."))
  (:documentation "A binary output stream whose octets are kept in memory,
taken by OUTPUT-STREAM-OCTETS."))

(defun make-octets-output-stream ()
  (make-instance 'octets-output-stream))

(defun output-stream-octets (stream)
  "The octets written to STREAM, an OCTETS-OUTPUT-STREAM, as a fresh simple vector."
  (subseq (stream-octets stream) 0 (stream-end stream)))

(defun octets-output-room (stream count)
  "STREAM's vector, with room for COUNT octets more after its END."
  (let ((octets (stream-octets stream))
        (needed (+ (stream-end stream) count)))
    (if (<= needed (length octets))
        octets
        (setf (stream-octets stream)
              (replace (make-array (max needed (* 2 (length octets))) :element-type '(unsigned-byte 8))
                       octets :end2 (stream-end stream))))))

(defmethod stream-element-type ((stream octets-output-stream))
  '(unsigned-byte 8))

(defmethod trivial-gray-streams:stream-write-byte ((stream octets-output-stream) byte)
  (setf (aref (octets-output-room stream 1) (stream-end stream)) byte)
  (incf (stream-end stream))
  byte)

(defmethod trivial-gray-streams:stream-write-sequence ((stream octets-output-stream) sequence start end &key)
  (let* ((end (or end (length sequence)))
         (count (- end start)))
    (replace (octets-output-room stream count) sequence :start1 (stream-end stream) :start2 start :end2 end)
    (incf (stream-end stream) count)
    sequence))

(defmethod trivial-gray-streams:stream-finish-output ((stream octets-output-stream))
  nil)

(defmethod trivial-gray-streams:stream-force-output ((stream octets-output-stream))
  nil)
