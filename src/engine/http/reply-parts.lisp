;;;; An HTTP/1.1 reply read back into its parts: how a reply written for
;;;; HTTP/1.1, by the engine or by Hunchentoot, leaves on HTTP/2 (RFC 9113
;;;; 8.3.2: a status pseudo-header, the header fields, the body as DATA).

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *connection-specific-headers* '("connection" "keep-alive" "transfer-encoding" "upgrade"
                                               "proxy-connection")
  "Headers of an HTTP/1.1 reply that HTTP/2 does not carry (RFC 9113 8.2.2).")

(defun head-end-position (octets)
  "Where the blank line ending the head in OCTETS starts (its CR), or NIL."
  (declare (type octets octets))
  (loop for index of-type fixnum from 0 below (- (length octets) 3)
        when (and (= (aref octets index) +cr+) (= (aref octets (+ index 1)) +lf+)
                  (= (aref octets (+ index 2)) +cr+) (= (aref octets (+ index 3)) +lf+))
          return index))

(defun latin-1-text (octets start end &key downcase)
  "The octets of OCTETS from START below END as a Latin-1 string, in lower
case when DOWNCASE."
  (declare (type octets octets) (type fixnum start end))
  (let ((text (make-string (- end start))))
    (loop for index of-type fixnum from start below end
          for char = (code-char (aref octets index))
          do (setf (schar text (- index start)) (if downcase (char-downcase char) char)))
    text))

(defun reply-header-fields (octets start end)
  "The header fields of the lines of OCTETS from START below END, each
ended by CR LF: an alist of lower-case names and values, the connection's
own and lines without a colon left out."
  (declare (type octets octets) (type fixnum start end))
  (flet ((blank-p (octet) (or (= octet 32) (= octet 9))))
    (declare (inline blank-p))
    (loop with fields = '()
          for line-start of-type fixnum = start then (+ line-end 2)
          while (< line-start end)
          for line-end of-type fixnum = (loop for index of-type fixnum from line-start below end
                                              when (= (aref octets index) +cr+) return index
                                              finally (return end))
          for colon = (loop for index of-type fixnum from line-start below line-end
                            when (= (aref octets index) #.(char-code #\:)) return index)
          do (when (and colon (> colon line-start))
               (let ((name (latin-1-text octets line-start colon :downcase t))
                     (value-start (1+ colon))
                     (value-end line-end))
                 (declare (type fixnum value-start value-end))
                 (loop while (and (< value-start value-end) (blank-p (aref octets value-start)))
                       do (incf value-start))
                 (loop while (and (> value-end value-start) (blank-p (aref octets (1- value-end))))
                       do (decf value-end))
                 (unless (member name *connection-specific-headers* :test #'string=)
                   (push (cons name (latin-1-text octets value-start value-end)) fields))))
          finally (return (nreverse fields)))))

(defun http1-reply-parts (octets)
  "The status, the headers (an alist of lower-case name and value strings,
the connection's own left out) and the body (octets, or NIL when empty)
of OCTETS, an HTTP/1.1 reply as this server writes one: a status line,
header lines, a blank line, the body whole (never chunked).  A 500 with
no header and no body when OCTETS hold no whole head."
  (declare (type octets octets))
  (let* ((head-end (head-end-position octets))
         (status-end (and head-end (position +cr+ octets)))
         (status (and status-end (>= status-end 12)
                      (parse-integer (latin-1-text octets 9 12) :junk-allowed t))))
    (if (null status)
        (values 500 '() nil)
        (values status
                (reply-header-fields octets (+ status-end 2) head-end)
                (let ((body-start (+ head-end 4)))
                  (when (< body-start (length octets))
                    (subseq octets body-start)))))))
