;;;; The Cookie header read as Hunchentoot's request initializer reads it,
;;;; without regular expressions: that reading (CL-PPCRE:SPLIT at
;;;; "\s*[,;]\s*", then at the first "=") was 9% of a returning user's
;;;; session request (bench/profiles/2026-11-27-application-sessions.txt).
;;;; Headers it would read otherwise than by these rules are left to it.

(in-package #:hunchentoot-recycling-taskmaster)

(defun cookie-field (header start end equals)
  "The pair (name . value) of the cookie field of HEADER from START below
END: split at its first =, at EQUALS (END when it has none), the name
trimmed of spaces."
  (declare (type fixnum start end equals))
  ;; Loops over the string's own kind: by POSITION with a :TEST, generic,
  ;; this was three fifths of reading a returning user's Cookie header
  ;; (bench/profiles/2026-11-29-same-moment.txt).
  (with-string-kind (header)
    (let* ((name-start (loop for index from start below equals
                             unless (char= (char header index) #\Space) return index
                             finally (return equals)))
           (name-end (loop for index from (1- equals) downto name-start
                           unless (char= (char header index) #\Space) return (1+ index)
                           finally (return name-start))))
      (cons (subseq header name-start name-end)
            (if (< equals end) (subseq header (1+ equals) end) "")))))

(defun cookie-header-fields (header)
  "The cookies of the Cookie header value HEADER, an alist of names and
values in order, as Hunchentoot's request initializer makes it: fields
split at each , and ; with the blanks (space, tab) around it, trailing
empty fields dropped, each field split at its first = (a field without
one is a name with the empty value), names trimmed of spaces.  :IRREGULAR
for a header that reading treats otherwise: one holding a line break or
form feed (blanks to its regular expression's \\s), or an empty field
before another (which it answers with an error, 400)."
  (let ((fields '())
        (field-start 0)
        (field-end nil)
        (equals nil)
        (empty-field-p nil)
        (end (length header)))
    ;; FIELD-END: past the field's last character that is not a blank, or
    ;; NIL while it has none.  EQUALS: the field's first =, or NIL, found
    ;; here so that COOKIE-FIELD need not look again (bench/profiles/
    ;; 2026-12-02-session-at-the-same-moment.txt).  EMPTY-FIELD-P: an empty
    ;; field was passed.
    (with-string-kind (header)
      (dotimes (index end)
        (let ((char (char header index)))
          (case char
            ((#\Linefeed #\Return #\Page)
             (return-from cookie-header-fields :irregular))
            ((#\; #\,)
             (if field-end
                 (push (cookie-field header field-start field-end (or equals field-end)) fields)
                 (setf empty-field-p t))
             (setf field-start (1+ index)
                   field-end nil
                   equals nil))
            ((#\Space #\Tab)
             ;; Blanks after a separator belong to it.
             (when (and (= index field-start) (plusp index))
               (setf field-start (1+ index))))
            (t
             (when empty-field-p
               (return-from cookie-header-fields :irregular))
             (when (and (char= char #\=) (null equals))
               (setf equals index))
             (setf field-end (1+ index)))))))
    (when (< field-start end)
      (push (cookie-field header field-start end (or equals end)) fields))
    (nreverse fields)))
