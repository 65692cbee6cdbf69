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

(defun make-zeroed-z-stream ()
  (let ((stream (cffi:foreign-alloc '(:struct z-stream))))
    (dotimes (index (cffi:foreign-type-size '(:struct z-stream)) stream)
      (setf (cffi:mem-aref stream :uint8 index) 0))))

(defun make-deflate-stream (level window-bits)
  "A new deflate stream at LEVEL with deflateInit2's WINDOW-BITS (negative
for raw deflate, over 15 for gzip), in foreign memory; free it with
FREE-GZIP-STREAM."
  (let ((stream (make-zeroed-z-stream)))
    (unless (eql +z-ok+ (%deflate-init2 stream level +z-deflated+ window-bits 8 0
                                        (%zlib-version) (cffi:foreign-type-size '(:struct z-stream))))
      (cffi:foreign-free stream)
      (error "zlib refused a deflate stream of level ~D and window bits ~D." level window-bits))
    stream))

(defun make-gzip-stream (level)
  "A new deflate stream writing gzip at LEVEL (1 to 9)."
  (make-deflate-stream level +gzip-window-bits+))

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

;;; Raw deflate, as permessage-deflate (RFC 7692) carries it.

(defconstant +raw-deflate-window-bits+ -15
  "deflateInit2's and inflateInit2's window bits for raw deflate with the
largest window.")

(cffi:defcfun ("inflateInit2_" %inflate-init2) :int
  (stream :pointer) (window-bits :int) (version :string) (stream-size :int))

(cffi:defcfun ("inflate" %inflate) :int
  (stream :pointer) (flush :int))

(cffi:defcfun ("inflateReset" %inflate-reset) :int
  (stream :pointer))

(cffi:defcfun ("inflateEnd" %inflate-end) :int
  (stream :pointer))

(defun make-inflate-stream ()
  "A new raw inflate stream, in foreign memory; free it with FREE-INFLATE-STREAM."
  (let ((stream (make-zeroed-z-stream)))
    (unless (eql +z-ok+ (%inflate-init2 stream +raw-deflate-window-bits+ (%zlib-version)
                                        (cffi:foreign-type-size '(:struct z-stream))))
      (cffi:foreign-free stream)
      (error "zlib refused an inflate stream."))
    stream))

(defun free-inflate-stream (stream)
  (%inflate-end stream)
  (cffi:foreign-free stream))

(defparameter *deflate-block-end* (make-array 4 :element-type '(unsigned-byte 8) :initial-contents '(0 0 255 255))
  "The empty stored block a sync flush ends with, which permessage-deflate
leaves out of a message (RFC 7692 7.2.1) and puts back to inflate it.")

(defun inflate-octets (stream input start end limit take)
  "Inflate the raw deflate octets of INPUT from START below END, then
*DEFLATE-BLOCK-END*, through STREAM, reset first.  The inflated octets, as
new octets; :TOO-LARGE as soon as they would pass LIMIT; :CORRUPT when the
input is not deflate.  TAKE, a function of a count of octets, is called
before each piece of output is made, and may refuse it (NIL): then
:REFUSED."
  (declare (type (simple-array (unsigned-byte 8) (*)) input) (type fixnum start end limit))
  (%inflate-reset stream)
  (let ((pieces '())
        (total 0)
        (ended nil))
    (flet ((feed (octets from to)
             (cffi:with-pointer-to-vector-data (in octets)
               (cffi:with-foreign-slots ((next-in avail-in next-out avail-out) stream (:struct z-stream))
                 (setf next-in (cffi:inc-pointer in from) avail-in (- to from))
                 (loop while (and (plusp avail-in) (not ended))
                       do (let* ((size (min 65536 (1+ (- limit total))))
                                 (output (if (funcall take size)
                                             (make-array size :element-type '(unsigned-byte 8))
                                             (return-from inflate-octets :refused)))
                                 (result (cffi:with-pointer-to-vector-data (out output)
                                           (setf next-out out avail-out size)
                                           (%inflate stream +z-sync-flush+)))
                                 (count (- size avail-out)))
                            (push (if (= count size) output (subseq output 0 count)) pieces)
                            (incf total count)
                            ;; A message may end with a final block: what
                            ;; follows it, the block end put back, is left.
                            (setf ended (eql result +z-stream-end+))
                            (cond ((> total limit) (return-from inflate-octets :too-large))
                                  ((not (member result (list +z-ok+ +z-stream-end+ +z-buf-error+)))
                                   (return-from inflate-octets :corrupt))
                                  ((and (eql result +z-buf-error+) (zerop count))
                                   (return-from inflate-octets :corrupt)))))))))
      (feed input start end)
      (feed *deflate-block-end* 0 4))
    (apply #'concatenate '(simple-array (unsigned-byte 8) (*)) (nreverse pieces))))

(defun make-raw-deflate-stream (level window-bits)
  "A new raw deflate stream at LEVEL with a window of WINDOW-BITS (9 to 15)."
  (make-deflate-stream level (- window-bits)))

(defun raw-deflate-message (stream input)
  "INPUT (octets) deflated through STREAM, reset first, as a
permessage-deflate message carries it: a sync flush, its final empty
block (*DEFLATE-BLOCK-END*) left out (RFC 7692 7.2.1)."
  (%deflate-reset stream)
  (let ((octets (gzip-more-octets stream input 0 (length input) :flush)))
    (subseq octets 0 (max 0 (- (length octets) 4)))))
