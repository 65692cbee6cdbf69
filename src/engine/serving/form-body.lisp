;;;; A form body (application/x-www-form-urlencoded) read into
;;;; HUNCHENTOOT:POST-PARAMETERS as Hunchentoot reads it, for the common
;;;; form: Hunchentoot's reading parses the Content-Type header through a
;;;; token reader on a stream, then splits the body and each field with
;;;; regular expressions and decodes every name and value through
;;;; flexi-streams: 47% of the server's time for a POST of three fields
;;;; (bench/profiles/2026-11-27-application-sessions.txt).  Anything else --
;;;; a Content-Type with parameters, an empty field between others, a field
;;;; with a %-escape or a character beyond ASCII -- is left to Hunchentoot.

(in-package #:hunchentoot-recycling-taskmaster)

(defun plain-form-content-type-p (content-type)
  "True when CONTENT-TYPE is the form type and nothing else, which
Hunchentoot reads as that type with the default external format."
  (and content-type (string-equal content-type "application/x-www-form-urlencoded")))

(defun hex-digit-value (char)
  "The value of CHAR as a hex digit, or NIL."
  (digit-char-p char 16))

(defun form-text (text start end)
  "The characters of TEXT from START below END, URL-decoded as Hunchentoot
decodes a form's in an ASCII-compatible external format (+ a space, %XX
the octet XX), or NIL when they hold a character beyond ASCII, a %-escape
of an octet beyond it, or one that is not two hex digits (all left to
Hunchentoot's decoding)."
  (let ((decoded (make-string (- end start)))
        (length 0)
        (index start))
    (loop while (< index end)
          do (let ((char (char text index)))
               (cond ((>= (char-code char) 128)
                      (return-from form-text nil))
                     ((char= char #\+)
                      (setf char #\Space))
                     ((char= char #\%)
                      (let ((high (and (< (+ index 2) end) (hex-digit-value (char text (+ index 1)))))
                            (low (and (< (+ index 2) end) (hex-digit-value (char text (+ index 2))))))
                        (unless (and high low (< high 8))
                          (return-from form-text nil))
                        (setf char (code-char (+ (* 16 high) low)))
                        (incf index 2))))
               (setf (char decoded length) char)
               (incf length)
               (incf index)))
    (subseq decoded 0 length)))

(defun form-fields (body)
  "The alist of names and values of the form BODY (its octets as Latin-1
characters), as Hunchentoot's reading makes it: fields split at &, trailing
empty ones dropped, each split at its first = and URL-decoded (FORM-TEXT),
names trimmed of spaces.  :IRREGULAR when Hunchentoot must read it (an
empty field before another, a field FORM-TEXT leaves to it)."
  (let ((fields '())
        (end (length body)))
    (loop for start = 0 then (1+ ampersand)
          for ampersand = (position #\& body :start start)
          for field-end = (or ampersand end)
          do (cond ((< start field-end)
                    (let* ((equals (position #\= body :start start :end field-end))
                           (name (form-text body start (or equals field-end)))
                           (value (if equals (form-text body (1+ equals) field-end) "")))
                      (unless (and name value)
                        (return-from form-fields :irregular))
                      (push (cons (string-trim " " name) value) fields)))
                   ;; An empty field: the last but for empty ones, or irregular.
                   ((find #\& body :start field-end :test #'char/=)
                    (return-from form-fields :irregular))
                   (t (loop-finish)))
          while ampersand)
    (nreverse fields)))

(defmethod hunchentoot:post-parameters :before ((request parallel-request))
  "Read a plain form body's fields (FORM-FIELDS) into REQUEST's POST
parameters before Hunchentoot's own method would, which then finds them
read.  Only where Hunchentoot would read them (a method of
HUNCHENTOOT:*METHODS-FOR-POST-PARAMETERS*, a Content-Length, none read yet)."
  (when (and (plain-form-content-type-p (hunchentoot:header-in :content-type request))
             (ascii-compatible-format-p hunchentoot:*hunchentoot-default-external-format*)
             (member (hunchentoot:request-method request) hunchentoot:*methods-for-post-parameters*)
             (hunchentoot:header-in :content-length request)
             (null (slot-value request 'hunchentoot:post-parameters))
             (null (slot-value request 'hunchentoot:raw-post-data)))
    (let ((fields (form-fields (hunchentoot:raw-post-data :request request :external-format :latin-1))))
      (unless (eq fields :irregular)
        (setf (slot-value request 'hunchentoot:post-parameters) fields)))))
