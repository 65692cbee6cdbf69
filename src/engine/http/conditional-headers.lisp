;;;; What the headers of a conditional request (RFC 9110 13) are made of:
;;;; HTTP dates (RFC 9110 5.6.7: IMF-fixdate, and the two obsolete forms a
;;;; recipient must still read) and lists of entity tags.

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *month-names* #("Jan" "Feb" "Mar" "Apr" "May" "Jun" "Jul" "Aug" "Sep" "Oct" "Nov" "Dec"))

(defun parse-http-date (text)
  "The universal time TEXT names as an HTTP date, or NIL."
  (flet ((date (day month year hour minute second)
           (let ((month-number (position month *month-names* :test #'string-equal)))
             (and month-number
                  (ignore-errors (encode-universal-time second minute hour day (1+ month-number) year 0))))))
    (or (cl-ppcre:register-groups-bind ((#'parse-integer day) month (#'parse-integer year hour minute second))
            ("^\\s*[A-Za-z]{3}, (\\d{2}) ([A-Za-z]{3}) (\\d{4}) (\\d{2}):(\\d{2}):(\\d{2}) GMT\\s*$" text)
          (date day month year hour minute second))
        (cl-ppcre:register-groups-bind ((#'parse-integer day) month (#'parse-integer two-digit-year hour minute second))
            ("^\\s*[A-Za-z]+, (\\d{2})-([A-Za-z]{3})-(\\d{2}) (\\d{2}):(\\d{2}):(\\d{2}) GMT\\s*$" text)
          ;; RFC 9110: a two-digit year more than 50 years ahead is in the past century.
          (let* ((this-year (nth-value 5 (decode-universal-time (get-universal-time) 0)))
                 (year (+ (* 100 (floor this-year 100)) two-digit-year)))
            (date day month (if (> year (+ this-year 50)) (- year 100) year) hour minute second)))
        (cl-ppcre:register-groups-bind (month (#'parse-integer day hour minute second year))
            ("^\\s*[A-Za-z]{3} ([A-Za-z]{3}) +(\\d{1,2}) (\\d{2}):(\\d{2}):(\\d{2}) (\\d{4})\\s*$" text)
          (date day month year hour minute second)))))

(defun entity-tag-listed-p (tag header-value)
  "True when the If-None-Match HEADER-VALUE names TAG or is *, compared
weakly (W/ aside), as RFC 9110 13.1.2 says."
  (flet ((opaque (text) (if (and (> (length text) 2) (string= "W/" text :end2 2)) (subseq text 2) text)))
    (let ((wanted (opaque tag)))
      (loop for listed in (cl-ppcre:split "\\s*,\\s*" (string-trim " " header-value))
            thereis (or (string= listed "*") (string= (opaque listed) wanted))))))
