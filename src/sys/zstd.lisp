;;;; Zstandard (Debian's libzstd1) through CFFI: a compression context made
;;;; once per worker, used for each reply.

(in-package #:hunchentoot-recycling-taskmaster)

(cffi:define-foreign-library zstd
  (t (:or "libzstd.so.1" "libzstd.so")))

(cffi:use-foreign-library zstd)

(cffi:defcfun ("ZSTD_createCCtx" make-zstd-context) :pointer)

(cffi:defcfun ("ZSTD_freeCCtx" free-zstd-context) :size
  (context :pointer))

(cffi:defcfun ("ZSTD_compressBound" zstd-bound) :size
  "The most octets Zstandard writes for SIZE octets."
  (size :size))

(cffi:defcfun ("ZSTD_isError" %zstd-error-p) :unsigned-int
  (code :size))

(cffi:defcfun ("ZSTD_compressCCtx" %zstd-compress) :size
  (context :pointer) (destination :pointer) (capacity :size) (source :pointer) (size :size) (level :int))

(defun zstd-octets (context level input output)
  "Write INPUT (octets) compressed at LEVEL into OUTPUT (octets, at least
ZSTD-BOUND long) through CONTEXT, one frame with its size.  The count of
octets written."
  (declare (type (simple-array (unsigned-byte 8) (*)) input output))
  (let ((written (cffi:with-pointer-to-vector-data (in input)
                   (cffi:with-pointer-to-vector-data (out output)
                     (%zstd-compress context out (length output) in (length input) level)))))
    (unless (zerop (%zstd-error-p written))
      (error "Zstandard did not compress ~D octets." (length input)))
    written))
