;;;; What a request says its server's authority is -- the Host header, or
;;;; the host of a target in absolute form -- and whether that is one
;;;; (RFC 9110 7.2, RFC 3986 3.2).  Pure functions of strings; the head's
;;;; parser (request-head.lisp) refuses a request whose authority is not.

(in-package #:hunchentoot-recycling-taskmaster)

(declaim (inline reg-name-char-p))
(defun reg-name-char-p (char)
  "RFC 3986 reg-name and IPv4address characters: unreserved, pct-encoded and
sub-delims; above ASCII, the letters and digits of Latin-1 as well, as
ALPHANUMERICP says."
  (let ((code (char-code char)))
    (if (< code 128)
        (or (<= 48 code 57) (<= 65 code 90) (<= 97 code 122)
            (case char ((#\- #\. #\_ #\~ #\% #\! #\$ #\& #\' #\( #\) #\* #\+ #\, #\; #\=) t)))
        (alphanumericp char))))

(defun valid-authority-p (authority)
  "True when AUTHORITY is uri-host [\":\" port] (RFC 9110 7.2), the empty
string included: a bracketed IP literal of hex digits, colons and dots, or
reg-name characters; then, optionally, a colon and digits.  Conses nothing:
it runs for every request."
  (declare (type string authority))
  (with-string-kind (authority)
    (macrolet ((char-position (char string)
                 `(loop for index of-type fixnum from 0 below (length ,string)
                        when (char= (char ,string index) ,char) return index))
               (all (test start end)
                 `(loop for index of-type fixnum from ,start below ,end
                        always (let ((char (char authority index))) ,test))))
      (let* ((length (length authority))
             (host-end (if (and (plusp length) (char= (char authority 0) #\[))
                           (let ((close (char-position #\] authority)))
                             (and close
                                  (all (or (digit-char-p char 16) (char= char #\:) (char= char #\.))
                                       1 close)
                                  (1+ close)))
                           (let ((colon (or (char-position #\: authority) length)))
                             (and (all (reg-name-char-p char) 0 colon) colon)))))
        (and host-end
             (or (= host-end length)
                 (and (char= (char authority host-end) #\:)
                      (all (char<= #\0 char #\9) (1+ host-end) length))))))))

(defun absolute-form-authority (uri)
  "The authority of URI when it is in absolute form (RFC 9112 3.2.2), else NIL."
  ;; Most targets are in origin form, which begins with a slash.
  (unless (and (plusp (length uri)) (char= (char uri 0) #\/))
    (let ((scheme-end (search "://" uri)))
      (when (and scheme-end
                 (member (subseq uri 0 scheme-end) '("http" "https") :test #'string-equal))
        (let* ((start (+ scheme-end 3))
               (end (or (position-if (lambda (char) (find char "/?#")) uri :start start) (length uri))))
          (subseq uri start end))))))
