;;;; A form body (application/x-www-form-urlencoded) read into
;;;; HUNCHENTOOT:POST-PARAMETERS as Hunchentoot reads it, for the common
;;;; form: Hunchentoot's reading parses the Content-Type header through a
;;;; token reader on a stream, then splits the body and each field with
;;;; regular expressions and decodes every name and value through
;;;; flexi-streams: 47% of the server's time for a POST of three fields
;;;; (bench/profiles/2026-11-27-application-sessions.txt).  Anything else --
;;;; a Content-Type with parameters, an empty field between others, an octet
;;;; beyond ASCII, plain or %-escaped -- is left to Hunchentoot.

(in-package #:hunchentoot-recycling-taskmaster)

(defun plain-form-content-type-p (content-type)
  "True when CONTENT-TYPE is the form type and nothing else, which
Hunchentoot reads as that type with the default external format."
  (and content-type (string-equal content-type "application/x-www-form-urlencoded")))

(defun hex-digit-value (octet)
  "The value of the ASCII character OCTET as a hex digit, or NIL."
  (digit-char-p (code-char octet) 16))

(defun form-text (octets start end)
  "The characters of OCTETS from START below END, URL-decoded as Hunchentoot
decodes a form's in an ASCII-compatible external format (+ a space, %XX
the octet XX), or NIL when they hold an octet beyond ASCII, a %-escape of
one, or one that is not two hex digits (all left to Hunchentoot's
decoding)."
  (declare (type octets octets) (type fixnum start end))
  (let ((decoded (make-string (- end start)))
        (length 0)
        (index start))
    (declare (type fixnum length index))
    (loop while (< index end)
          do (let ((octet (aref octets index)))
               (cond ((>= octet 128)
                      (return-from form-text nil))
                     ((= octet #.(char-code #\+))
                      (setf octet #.(char-code #\Space)))
                     ((= octet #.(char-code #\%))
                      (let ((high (and (< (+ index 2) end) (hex-digit-value (aref octets (+ index 1)))))
                            (low (and (< (+ index 2) end) (hex-digit-value (aref octets (+ index 2))))))
                        (unless (and high low (< high 8))
                          (return-from form-text nil))
                        (setf octet (+ (* 16 high) low))
                        (incf index 2))))
               (setf (schar decoded length) (code-char octet))
               (incf length)
               (incf index)))
    ;; Only %-escapes make the text shorter than its octets.
    (if (= length (- end start)) decoded (subseq decoded 0 length))))

(defun form-fields (octets)
  "The alist of names and values of the form body OCTETS, as Hunchentoot's
reading makes it: fields split at &, trailing empty ones dropped, each
split at its first = and URL-decoded (FORM-TEXT), names trimmed of spaces.
:IRREGULAR when Hunchentoot must read it (an empty field before another,
a field FORM-TEXT leaves to it)."
  (declare (type octets octets))
  (let ((fields '())
        (end (length octets)))
    (flet ((next (char start &optional (end end))
             (octet-position (char-code char) octets start end)))
      (loop for start = 0 then (1+ ampersand)
            for ampersand = (next #\& start)
            for field-end = (or ampersand end)
            do (cond ((< start field-end)
                      (let* ((equals (next #\= start field-end))
                             (name (form-text octets start (or equals field-end)))
                             (value (if equals (form-text octets (1+ equals) field-end) "")))
                        (unless (and name value)
                          (return-from form-fields :irregular))
                        (push (cons (string-trim " " name) value) fields)))
                     ;; An empty field: the last but for empty ones, or irregular.
                     ((find (char-code #\&) octets :start field-end :test #'/=)
                      (return-from form-fields :irregular))
                     (t (loop-finish)))
            while ampersand))
    (nreverse fields)))

(defmethod hunchentoot:post-parameters :before ((request parallel-request))
  "Read a plain form body's fields (FORM-FIELDS) into REQUEST's POST
parameters before Hunchentoot's own method would, which then finds them
read.  Only where Hunchentoot would read them (a method of
HUNCHENTOOT:*METHODS-FOR-POST-PARAMETERS*, a Content-Length, none read yet)."
  (when (and (null (slot-value request 'hunchentoot:post-parameters))
             (null (slot-value request 'hunchentoot:raw-post-data))
             (plain-form-content-type-p (hunchentoot:header-in :content-type request))
             (ascii-compatible-format-p hunchentoot:*hunchentoot-default-external-format*)
             (member (hunchentoot:request-method request) hunchentoot:*methods-for-post-parameters*)
             (hunchentoot:header-in :content-length request))
    (let* ((octets (hunchentoot:raw-post-data :request request :force-binary t))
           ;; Hunchentoot reads no body of Content-Length 0.
           (fields (if (typep octets 'octets) (form-fields octets) :irregular)))
      (unless (eq fields :irregular)
        (setf (slot-value request 'hunchentoot:post-parameters) fields)))))
