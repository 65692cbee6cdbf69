;;;; Finding where a chunked body (RFC 9112 7.1) ends while it arrives.  The
;;;; engine reads a chunked body that has not all come with its head as it
;;;; reads a Content-Length one (readiness/arriving-body.lisp), keeping its
;;;; octets as they came, framing and all, and hands the handler the decoder
;;;; (chunked-body.lisp) over them once the last chunk and the trailer
;;;; section are in.  CHUNK-FRAMING follows the framing octet by octet,
;;;; across reads, so that the engine knows where the body ends and refuses
;;;; a body the decoder would refuse, by the same limits, before any
;;;; handler runs.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +max-chunk-line-bytes+ 4096
  "The longest chunk-size line, chunk extensions included.")

(defconstant +max-chunk-size-digits+ 15
  "The most hexadecimal digits of a chunk size: sizes below 2^60.")

(defconstant +max-trailer-bytes+ 16384
  "The largest trailer section of a chunked body.")

(defstruct (chunk-framing (:constructor make-chunk-framing (octets-left)))
  "How far the framing of a chunked body has been followed."
  ;; Where in the framing the next octet falls: :SIZE (the digits of a chunk
  ;; size), :SIZE-TAIL (its extensions), :SIZE-LF, :DATA, :DATA-CR, :DATA-LF,
  ;; :TRAILER (a trailer line, or the empty line ending the section),
  ;; :TRAILER-LF.
  (state :size :type keyword)
  ;; The digits of the current chunk size, and its value so far; in :DATA,
  ;; the octets of the chunk's data still to come.
  (digits 0 :type fixnum)
  (size 0 :type (integer 0))
  ;; The octets of the current chunk-size or trailer line so far.
  (line-octets 0 :type fixnum)
  ;; The octets the trailer section may still take.
  (trailer-budget +max-trailer-bytes+ :type fixnum)
  ;; How many more octets of chunk data the acceptor's MAX-BODY-BYTES
  ;; allows, or NIL for no limit.
  (octets-left nil))

(defun add-line-octet (framing limit)
  "Count one more octet of the current chunk-size or trailer line of
FRAMING; false when the line is then longer than LIMIT."
  (<= (incf (chunk-framing-line-octets framing)) limit))

(defun scan-chunk-framing (framing buffer start end)
  "Follow FRAMING through the octets of BUFFER from START below END.
Returns :COMPLETE and the position after the body's last octet, :INCOMPLETE
when the body goes on past END, or :REFUSE and the status the request is
to be answered (400 for broken framing, 413 for chunks beyond the limit)."
  (declare (type octets buffer) (type fixnum start end))
  (let ((position start))
    (declare (type fixnum position))
    (macrolet ((refuse (status) `(return-from scan-chunk-framing (values :refuse ,status)))
               (enter (state) `(setf (chunk-framing-state framing) ,state))
               (begin-line (state) `(setf (chunk-framing-line-octets framing) 0
                                          (chunk-framing-state framing) ,state)))
      (loop while (< position end)
            do (let ((octet (aref buffer position)))
                 (ecase (chunk-framing-state framing)
                   (:size
                    (let ((digit (digit-char-p (code-char octet) 16)))
                      (cond (digit
                             (when (> (incf (chunk-framing-digits framing)) +max-chunk-size-digits+)
                               (refuse 400))
                             (setf (chunk-framing-size framing) (+ (* 16 (chunk-framing-size framing)) digit))
                             (add-line-octet framing +max-chunk-line-bytes+))
                            ((zerop (chunk-framing-digits framing)) (refuse 400))
                            ((= octet +cr+) (enter :size-lf))
                            ((member octet '(59 32 9)) ; ; SP HT: extensions follow
                             (add-line-octet framing +max-chunk-line-bytes+)
                             (enter :size-tail))
                            (t (refuse 400)))))
                   (:size-tail
                    (cond ((= octet +cr+) (enter :size-lf))
                          ((= octet +lf+) (refuse 400))
                          ((not (add-line-octet framing +max-chunk-line-bytes+)) (refuse 400))))
                   (:size-lf
                    (unless (= octet +lf+) (refuse 400))
                    (let ((size (chunk-framing-size framing))
                          (left (chunk-framing-octets-left framing)))
                      (cond ((zerop size) (begin-line :trailer))
                            (t (when left
                                 (when (> size left) (refuse 413))
                                 (setf (chunk-framing-octets-left framing) (- left size)))
                               (enter :data)))))
                   (:data
                    (let ((taken (min (chunk-framing-size framing) (- end position))))
                      (decf (chunk-framing-size framing) taken)
                      (incf position (1- taken))
                      (when (zerop (chunk-framing-size framing))
                        (enter :data-cr))))
                   (:data-cr (if (= octet +cr+) (enter :data-lf) (refuse 400)))
                   (:data-lf
                    (unless (= octet +lf+) (refuse 400))
                    (setf (chunk-framing-digits framing) 0)
                    (begin-line :size))
                   (:trailer
                    (cond ((= octet +cr+) (enter :trailer-lf))
                          ((= octet +lf+) (refuse 400))
                          ((not (add-line-octet framing (chunk-framing-trailer-budget framing))) (refuse 400))))
                   (:trailer-lf
                    (unless (= octet +lf+) (refuse 400))
                    (when (zerop (chunk-framing-line-octets framing))
                      (return-from scan-chunk-framing (values :complete (1+ position))))
                    (when (minusp (decf (chunk-framing-trailer-budget framing)
                                        (+ 2 (chunk-framing-line-octets framing))))
                      (refuse 400))
                    (begin-line :trailer)))
                 (incf position)))
      (values :incomplete end))))
