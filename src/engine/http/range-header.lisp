;;;; The Range header's grammar (RFC 9110 14.1.1): which byte ranges a
;;;; request asks for, read once for the head parser, which leaves out an
;;;; invalid Range; and which ranges of a file of a known size it asks for
;;;; (RFC 9110 14.1.2), for the static files, which answer a valid one.

(in-package #:hunchentoot-recycling-taskmaster)

(defun parse-range-spec (text)
  "The range-spec TEXT (RFC 9110 14.1.1) as (FIRST . LAST), LAST NIL for an
open range and never below FIRST, or (NIL . LENGTH) for a suffix range;
NIL when it is none of them."
  (flet ((number-between (start end)
           (and (< start end)
                (loop for index from start below end always (char<= #\0 (char text index) #\9))
                (parse-integer text :start start :end end))))
    (let ((dash (position #\- text))
          (end (length text)))
      (cond ((null dash) nil)
            ((zerop dash)
             (let ((length (number-between 1 end)))
               (and length (cons nil length))))
            (t
             (let ((first (number-between 0 dash)))
               (cond ((null first) nil)
                     ((= dash (1- end)) (cons first nil))
                     (t (let ((last (number-between (1+ dash) end)))
                          (and last (<= first last) (cons first last)))))))))))

(defun parse-range-specs (value)
  "The ranges the Range header VALUE asks for, in its order, each as
PARSE-RANGE-SPEC makes it, when VALUE is a bytes ranges-specifier (RFC 9110
14.1.1: bytes=, then specs separated by commas, whitespace allowed around
= and commas); NIL when it is not: another unit, no spec, or a spec that is
malformed or inverted (bytes=5-2)."
  (cl-ppcre:register-groups-bind (list) ("^\\s*bytes\\s*=\\s*(.*?)\\s*$" value)
    (let ((ranges (mapcar #'parse-range-spec (cl-ppcre:split "\\s*,\\s*" list))))
      (and ranges (every #'identity ranges) ranges))))

(defun without-invalid-range (headers)
  "HEADERS without a Range header that is not a valid bytes
ranges-specifier (PARSE-RANGE-SPECS): RFC 9110 14.2 lets a server ignore
one, and ignoring it here means every handler does (Hunchentoot's
HANDLE-STATIC-FILE would answer bytes=5-2 with 206 and a negative
Content-Length)."
  (let ((range (assoc :range headers)))
    (if (and range (null (parse-range-specs (cdr range))))
        (remove range headers)
        headers)))

(defconstant +max-byte-ranges+ 16
  "The most ranges one Range header may ask for; past it the header is
ignored and the whole file sent (RFC 9110 14.2 lets a server ignore many
small ranges, a sign of a broken client or of an attack).")

(defun coalesced-ranges (ranges)
  "RANGES, (START . END) pairs, as they are when none overlaps or touches
another; else sorted, with each run of overlapping or adjacent ranges made
one (RFC 9110 15.3.7.2 lets a server coalesce them, whatever their order)."
  (let ((sorted (sort (copy-list ranges) #'< :key #'car)))
    (if (loop for (range next) on sorted
              never (and next (<= (car next) (cdr range))))
        ranges
        (let ((merged '()))
          (dolist (range sorted (nreverse merged))
            (if (and merged (<= (car range) (cdr (first merged))))
                (setf (cdr (first merged)) (max (cdr (first merged)) (cdr range)))
                (push (cons (car range) (cdr range)) merged)))))))

(defun parse-byte-ranges (header-value size)
  "The ranges the Range HEADER-VALUE asks of a file of SIZE octets: a list
of (START . END) with END exclusive, clamped to the file, overlapping and
adjacent ones coalesced; :UNSATISFIABLE when none overlaps it; NIL when the
header is to be ignored and the whole file sent once: not a bytes
ranges-specifier (PARSE-RANGE-SPECS), more than +MAX-BYTE-RANGES+ ranges,
or ranges adding up to more than the file (as nginx does: 64 times 0- is
one file, not 64)."
  (let ((specs (parse-range-specs header-value)))
    (when (and specs (<= (length specs) +max-byte-ranges+))
      (let ((ranges (loop for (first . last) in specs
                          ;; A suffix range is (NIL . LENGTH); LAST is NIL for an open range.
                          for range = (if first
                                          (and (< first size) (cons first (if last (min size (1+ last)) size)))
                                          (and (plusp last) (plusp size) (cons (max 0 (- size last)) size)))
                          when range collect range)))
        (cond ((null ranges) :unsatisfiable)
              ((> (loop for (start . end) in ranges sum (- end start)) size) nil)
              (t (coalesced-ranges ranges)))))))
