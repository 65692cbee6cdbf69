;;;; zlib (Debian's zlib1g) through CFFI: a deflate stream writing the gzip
;;;; format, made once per worker and reset for each reply.

(in-package #:hunchentoot-recycling-taskmaster)

(cffi:define-foreign-library zlib
  (t (:or "libz.so.1" "libz.so")))

(cffi:use-foreign-library zlib)

(cffi:defcstruct z-stream
  (next-in :pointer)
  (avail-in :unsigned-int)
  (total-in :unsigned-long)
  (next-out :pointer)
  (avail-out :unsigned-int)
  (total-out :unsigned-long)
  (msg :pointer)
  (state :pointer)
  (zalloc :pointer)
  (zfree :pointer)
  (opaque :pointer)
  (data-type :int)
  (adler :unsigned-long)
  (reserved :unsigned-long))

(assert (= 112 (cffi:foreign-type-size '(:struct z-stream))) ()
        "zlib's z_stream is 112 octets on x86-64 Linux, not ~D." (cffi:foreign-type-size '(:struct z-stream)))

(defconstant +z-ok+ 0)
(defconstant +z-stream-end+ 1)
(defconstant +z-finish+ 4)
(defconstant +z-deflated+ 8)
(defconstant +gzip-window-bits+ (+ 15 16)
  "deflateInit2's window bits for the largest window, written in the gzip format.")

(cffi:defcfun ("zlibVersion" %zlib-version) :string)

(cffi:defcfun ("deflateInit2_" %deflate-init2) :int
  (stream :pointer) (level :int) (method :int) (window-bits :int) (memory-level :int) (strategy :int)
  (version :string) (stream-size :int))

(cffi:defcfun ("deflate" %deflate) :int
  (stream :pointer) (flush :int))

(cffi:defcfun ("deflateReset" %deflate-reset) :int
  (stream :pointer))

(cffi:defcfun ("deflateEnd" %deflate-end) :int
  (stream :pointer))

(cffi:defcfun ("deflateBound" %deflate-bound) :unsigned-long
  (stream :pointer) (source-length :unsigned-long))

(defun make-gzip-stream (level)
  "A new deflate stream writing gzip at LEVEL (1 to 9), in foreign memory;
free it with FREE-GZIP-STREAM."
  (let ((stream (cffi:foreign-alloc '(:struct z-stream))))
    (dotimes (index (cffi:foreign-type-size '(:struct z-stream)))
      (setf (cffi:mem-aref stream :uint8 index) 0))
    (unless (eql +z-ok+ (%deflate-init2 stream level +z-deflated+ +gzip-window-bits+ 8 0
                                        (%zlib-version) (cffi:foreign-type-size '(:struct z-stream))))
      (cffi:foreign-free stream)
      (error "zlib refused a gzip stream of level ~D." level))
    stream))

(defun free-gzip-stream (stream)
  (%deflate-end stream)
  (cffi:foreign-free stream))

(defun reset-gzip-stream (stream)
  "Make STREAM ready to begin a new gzip stream."
  (%deflate-reset stream))

(defun gzip-bound (stream octets)
  "The most octets gzip writes for OCTETS octets."
  (%deflate-bound stream octets))

(defun gzip-octets (stream input output)
  "Write INPUT (octets) gzipped into OUTPUT (octets, at least GZIP-BOUND
long) through STREAM, reset first.  The count of octets written."
  (declare (type (simple-array (unsigned-byte 8) (*)) input output))
  (%deflate-reset stream)
  (cffi:with-pointer-to-vector-data (in input)
    (cffi:with-pointer-to-vector-data (out output)
      (cffi:with-foreign-slots ((next-in avail-in next-out avail-out total-out) stream (:struct z-stream))
        (setf next-in in avail-in (length input)
              next-out out avail-out (length output))
        (unless (eql +z-stream-end+ (%deflate stream +z-finish+))
          (error "zlib did not finish a gzip stream of ~D octets." (length input)))
        total-out))))

(defconstant +z-no-flush+ 0)
(defconstant +z-sync-flush+ 2)
(defconstant +z-buf-error+ -5
  "deflate's answer when it could make no progress: not an error here.")

(defun gzip-more-octets (stream input start end flush)
  "Feed the octets of INPUT from START below END to STREAM, a gzip stream
under way, and return what it wrote meanwhile, as new octets: with FLUSH
:MORE what it chose to, :FLUSH everything so far (a sync flush, so that
the client can decode all it got), :FINISH the rest and the gzip trailer."
  (declare (type (simple-array (unsigned-byte 8) (*)) input) (type fixnum start end))
  (let ((mode (ecase flush (:more +z-no-flush+) (:flush +z-sync-flush+) (:finish +z-finish+)))
        (output (make-array 16384 :element-type '(unsigned-byte 8)))
        (pieces '()))
    (cffi:with-pointer-to-vector-data (in input)
      (cffi:with-foreign-slots ((next-in avail-in next-out avail-out) stream (:struct z-stream))
        (setf next-in (cffi:inc-pointer in start) avail-in (- end start))
        (loop
          (let ((result (cffi:with-pointer-to-vector-data (out output)
                          (setf next-out out avail-out (length output))
                          (%deflate stream mode))))
            (unless (member result (list +z-ok+ +z-stream-end+ +z-buf-error+))
              (error "zlib failed (~D) in a gzip stream." result))
            (push (subseq output 0 (- (length output) avail-out)) pieces)
            (when (or (eql result +z-stream-end+) (eql result +z-buf-error+)
                      (and (/= mode +z-finish+) (plusp avail-out) (zerop avail-in)))
              (return))))))
    (apply #'concatenate '(simple-array (unsigned-byte 8) (*)) (nreverse pieces))))
