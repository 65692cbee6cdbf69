;;;; Following the framing of a chunked body (RFC 9112 7.1) octet by octet:
;;;; the rules and limits of chunked coding, stated once.  The engine reads a
;;;; chunked body that has not all come with its head as it reads a
;;;; Content-Length one (readiness/arriving-body.lisp), keeping its octets
;;;; as they came, framing and all; SCAN-CHUNK-FRAMING follows them across
;;;; reads, so that the engine knows where the body ends and refuses a
;;;; broken one before any handler runs.  The decoder a handler then reads
;;;; the body through (chunked-body.lisp) follows the framing again with
;;;; ADVANCE-CHUNK-FRAMING, taking the data out.

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

;; The scanner and the decoder follow the framing one octet at a time, up
;; to six octets of it for each of data (bench/run chunked-body).
(declaim (inline add-line-octet chunk-data-follows-p take-chunk-data advance-chunk-framing))

(defun add-line-octet (framing limit)
  "Count one more octet of the current chunk-size or trailer line of
FRAMING; false when the line is then longer than LIMIT."
  (<= (incf (chunk-framing-line-octets framing)) limit))

(defun chunk-data-follows-p (framing)
  "True when FRAMING's next octets are chunk data: CHUNK-FRAMING-SIZE of
them, taken by TAKE-CHUNK-DATA rather than octet by octet."
  (eq (chunk-framing-state framing) :data))

(defun take-chunk-data (framing count)
  "COUNT octets of the current chunk's data, at most what is left of it,
have gone by."
  (when (zerop (decf (chunk-framing-size framing) count))
    (setf (chunk-framing-state framing) :data-cr)))

(defun advance-chunk-framing (framing octet)
  "Follow FRAMING through OCTET, which is not chunk data.  Returns NIL while
the body goes on; :COMPLETE when OCTET was its last; or the status the body
is refused with, 400 for broken framing or 413 for chunks beyond the
limit, and a phrase saying why."
  (declare (type (unsigned-byte 8) octet))
  (macrolet ((refuse (status reason) `(return-from advance-chunk-framing (values ,status ,reason)))
             (enter (state) `(setf (chunk-framing-state framing) ,state))
             (begin-line (state) `(setf (chunk-framing-line-octets framing) 0
                                        (chunk-framing-state framing) ,state)))
    (ecase (chunk-framing-state framing)
      (:size
       (let ((digit (and (< octet 128) (digit-char-p (code-char octet) 16))))
         (cond (digit
                (when (> (incf (chunk-framing-digits framing)) +max-chunk-size-digits+)
                  (refuse 400 "a chunk size of more than 15 hexadecimal digits"))
                (setf (chunk-framing-size framing) (+ (* 16 (chunk-framing-size framing)) digit))
                (add-line-octet framing +max-chunk-line-bytes+))
               ((zerop (chunk-framing-digits framing)) (refuse 400 "a chunk-size line without a size"))
               ((= octet +cr+) (enter :size-lf))
               ((member octet '(59 32 9)) ; ; SP HT: extensions follow
                (add-line-octet framing +max-chunk-line-bytes+)
                (enter :size-tail))
               (t (refuse 400 "a chunk size followed by something else than an extension")))))
      (:size-tail
       (cond ((= octet +cr+) (enter :size-lf))
             ((= octet +lf+) (refuse 400 "a chunk-size line ending with a bare LF"))
             ((not (add-line-octet framing +max-chunk-line-bytes+))
              (refuse 400 "a chunk-size line longer than 4 KiB"))))
      (:size-lf
       (unless (= octet +lf+) (refuse 400 "a chunk-size line with a CR not followed by LF"))
       (let ((size (chunk-framing-size framing))
             (left (chunk-framing-octets-left framing)))
         (cond ((zerop size) (begin-line :trailer))
               (t (when left
                    (when (> size left) (refuse 413 "chunks beyond the body's limit"))
                    (setf (chunk-framing-octets-left framing) (- left size)))
                  (enter :data)))))
      (:data-cr (if (= octet +cr+) (enter :data-lf) (refuse 400 "chunk data not followed by CRLF")))
      (:data-lf
       (unless (= octet +lf+) (refuse 400 "chunk data not followed by CRLF"))
       (setf (chunk-framing-digits framing) 0)
       (begin-line :size))
      (:trailer
       (cond ((= octet +cr+) (enter :trailer-lf))
             ((= octet +lf+) (refuse 400 "a trailer line ending with a bare LF"))
             ((not (add-line-octet framing (chunk-framing-trailer-budget framing)))
              (refuse 400 "a trailer section longer than 16 KiB"))))
      (:trailer-lf
       (unless (= octet +lf+) (refuse 400 "a trailer line with a CR not followed by LF"))
       (when (zerop (chunk-framing-line-octets framing))
         (return-from advance-chunk-framing :complete))
       (when (minusp (decf (chunk-framing-trailer-budget framing) (+ 2 (chunk-framing-line-octets framing))))
         (refuse 400 "a trailer section longer than 16 KiB"))
       (begin-line :trailer)))
    nil))

(defun scan-chunk-framing (framing buffer start end)
  "Follow FRAMING through the octets of BUFFER from START below END.
Returns :COMPLETE and the position after the body's last octet, :INCOMPLETE
when the body goes on past END, or :REFUSE and the status the request is
to be answered (400 for broken framing, 413 for chunks beyond the limit)."
  (declare (type octets buffer) (type fixnum start end))
  (let ((position start))
    (declare (type fixnum position))
    (loop while (< position end)
          do (if (chunk-data-follows-p framing)
                 (let ((taken (min (chunk-framing-size framing) (- end position))))
                   (take-chunk-data framing taken)
                   (incf position taken))
                 (let ((outcome (advance-chunk-framing framing (aref buffer position))))
                   (incf position)
                   (case outcome
                     ((nil))
                     (:complete (return-from scan-chunk-framing (values :complete position)))
                     (t (return-from scan-chunk-framing (values :refuse outcome)))))))
    (values :incomplete end)))
