;;;; The Range header's grammar (RFC 9110 14.1.1): which byte ranges a
;;;; request asks for, read once for the head parser, which leaves out an
;;;; invalid Range, and for the static files, which answer a valid one.

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
