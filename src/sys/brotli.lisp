;;;; Brotli's encoder (Debian's libbrotli1) through CFFI, its one-shot call.

(in-package #:hunchentoot-recycling-taskmaster)

(cffi:define-foreign-library brotli-encoder
  (t (:or "libbrotlienc.so.1" "libbrotlienc.so")))

(cffi:use-foreign-library brotli-encoder)

(defconstant +brotli-text-mode+ 1)
(defconstant +brotli-default-window+ 22)

(cffi:defcfun ("BrotliEncoderMaxCompressedSize" brotli-bound) :size
  "The most octets Brotli writes for SIZE octets (0 when SIZE is too large)."
  (size :size))

(cffi:defcfun ("BrotliEncoderCompress" %brotli-compress) :int
  (quality :int) (window :int) (mode :int) (size :size) (input :pointer)
  (encoded-size :pointer) (encoded :pointer))

(defun brotli-octets (quality input output)
  "Write INPUT (octets, text) compressed at QUALITY (0 to 11) into OUTPUT
(octets, at least BROTLI-BOUND long).  The count of octets written."
  (declare (type (simple-array (unsigned-byte 8) (*)) input output))
  (cffi:with-foreign-object (written :size)
    (setf (cffi:mem-ref written :size) (length output))
    (unless (eql 1 (cffi:with-pointer-to-vector-data (in input)
                     (cffi:with-pointer-to-vector-data (out output)
                       (%brotli-compress quality +brotli-default-window+ +brotli-text-mode+
                                         (length input) in written out))))
      (error "Brotli did not compress ~D octets." (length input)))
    (cffi:mem-ref written :size)))
