;;;; A session cookie's value, "ID:STRING" as Hunchentoot's
;;;; SESSION-COOKIE-VALUE makes it, read as Hunchentoot's SESSION-VERIFY
;;;; reads it, and told from a forgery before anything is looked up.

(in-package #:hunchentoot-recycling-taskmaster)

(defun parse-decimal-digits (string end)
  "The integer of the decimal digits of STRING below END, which are all ASCII
digits."
  ;; 18 digits at a time in a fixnum: PARSE-INTEGER makes a new bignum at
  ;; each digit past a fixnum's (bench/profiles/2026-11-28-per-core.txt).
  ;; Over the string's own kind, the powers of ten from a table: generic
  ;; character access and EXPT were a quarter of verifying a session
  ;; (bench/profiles/2026-11-29-costs-per-request.txt).
  (declare (type fixnum end))
  (let ((powers (load-time-value (coerce (loop for digits from 0 to 18 collect (expt 10 digits)) 'simple-vector) t))
        (value 0))
    (with-string-kind (string)
      (loop for start of-type fixnum from 0 below end by 18
            for chunk-end of-type fixnum = (min end (+ start 18))
            do (let ((chunk 0))
                 (declare (type (unsigned-byte 62) chunk))
                 (loop for index of-type fixnum from start below chunk-end
                       do (setf chunk (+ (* chunk 10) (- (char-code (char string index)) (char-code #\0)))))
                 (setf value (+ (* value (the fixnum (svref powers (- chunk-end start)))) chunk)))))
    value))

(defun parse-session-identifier (identifier)
  "The session id (an integer) and session string of the cookie value
IDENTIFIER, \"ID:STRING\" as HUNCHENTOOT:SESSION-COOKIE-VALUE makes it, or
NIL when it cannot be one: the id at most 40 ASCII digits, the string (an
MD5 in hex, as Hunchentoot makes it) at most 128 hex digits.  So a forged
cookie is told at once, and no client's bytes reach a session store."
  (when (stringp identifier)
    (let ((end (length identifier)))
      (with-string-kind (identifier)
        ;; The id's digits end at the colon, within 41 characters; lengths
        ;; are checked before the string's digits are looked at.
        (let ((colon (loop for index from 0 below (min end 41)
                           for char = (char identifier index)
                           unless (char<= #\0 char #\9)
                             return (and (char= char #\:) index))))
          (when (and colon (<= 1 colon) (<= 1 (- end colon 1) 128)
                     (loop for index from (1+ colon) below end
                           always (let ((char (char identifier index)))
                                    (or (char<= #\0 char #\9) (char<= #\a char #\f) (char<= #\A char #\F)))))
            (values (parse-decimal-digits identifier colon)
                    (subseq identifier (1+ colon)))))))))

(defun url-decoded-cookie (cookie)
  "COOKIE URL-decoded as Hunchentoot's SESSION-VERIFY decodes it: itself
when it is ASCII without % or +, which decoding leaves as they are."
  (if (with-string-kind (cookie)
        (loop for index from 0 below (length cookie)
              always (let ((char (char cookie index)))
                       (and (< (char-code char) 128) (char/= char #\%) (char/= char #\+)))))
      cookie
      (hunchentoot:url-decode cookie)))
