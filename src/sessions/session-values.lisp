;;;; Session values as the text a shared session store keeps.
;;;;
;;;; A session's values (an alist of key symbols and values) are written as
;;;; readable data under standard syntax and read back with *READ-EVAL*
;;;; false, then checked against the same whitelist of types they were
;;;; written under: nothing read back is evaluated, and nothing becomes an
;;;; object of a class the application did not store.  The whitelist:
;;;; numbers, characters, strings, interned symbols, and conses and simple
;;;; vectors of these, nested at most +STORABLE-DEPTH+ deep, each list at
;;;; most +STORABLE-LENGTH+ long.  Symbols are
;;;; written with their package, so that every process reads the same
;;;; symbol back, and a package a reading process lacks makes the text
;;;; unreadable there rather than a symbol somewhere else.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +storable-depth+ 100
  "How deep conses and vectors may nest in a stored value.")

(defconstant +storable-length+ 1000000
  "The most elements a list in a stored value may have (so that a circular
list is refused rather than walked forever).")

(defpackage #:hunchentoot-recycling-taskmaster.session-values
  (:use)
  (:documentation "The package under which session values are written and
read: it uses no package, so every symbol is written with its own."))

(defun storable-value-p (value &optional (depth 0))
  "True when VALUE is of the whitelist a shared store keeps (see above)."
  (cond ((> depth +storable-depth+) nil)
        ((typep value '(or number character string)) t)
        ((symbolp value) (not (null (symbol-package value))))
        ((consp value)
         ;; A list is walked along its conses, so that a long list costs no depth.
         (loop for tail = value then (cdr tail)
               for count from 0
               while (consp tail)
               always (and (< count +storable-length+)
                           (storable-value-p (car tail) (1+ depth)))
               finally (return (or (null tail) (storable-value-p tail (1+ depth))))))
        ((simple-vector-p value)
         (every (lambda (element) (storable-value-p element (1+ depth))) value))
        (t nil)))

(defun storable-data-p (data)
  "True when DATA is a session's values: a proper alist of interned symbols
and storable values."
  (and (listp data)
       (null (cdr (last data)))
       (every (lambda (entry)
                (and (consp entry)
                     (symbolp (car entry))
                     (symbol-package (car entry))
                     (storable-value-p (cdr entry))))
              data)))

(defun make-session-value-readtable ()
  "The standard readtable without the # syntaxes that run code or build
what the printer never writes for a storable value: #S (a structure's
constructor and initforms), #. (already off with *READ-EVAL* false), #= and
## (shared and circular structure)."
  (let ((readtable (copy-readtable nil)))
    (dolist (character '(#\S #\. #\= #\#) readtable)
      (set-dispatch-macro-character
       #\# character
       (lambda (stream character argument)
         (declare (ignore argument))
         (error 'reader-error :stream stream
                              :format-control "#~C is not read in session values"
                              :format-arguments (list character)))
       readtable))))

(defvar *session-value-readtable* (make-session-value-readtable)
  "The readtable session values are read with.")

(defmacro with-session-value-syntax (() &body body)
  "Run BODY with the printer and reader settings session values are written
and read under."
  `(with-standard-io-syntax
     (let ((*package* (find-package '#:hunchentoot-recycling-taskmaster.session-values))
           (*readtable* *session-value-readtable*)
           (*read-eval* nil)
           (*print-circle* nil))
       ,@body)))

(defun session-data-text (data)
  "The text a store keeps for the session values DATA.  Signals
SESSION-VALUE-NOT-STORABLE for the first value outside the whitelist."
  (dolist (entry data)
    (unless (and (consp entry) (symbolp (car entry)) (symbol-package (car entry))
                 (storable-value-p (cdr entry)))
      (error 'session-value-not-storable
             :key (if (consp entry) (car entry) entry)
             :value-type (if (consp entry) (type-of (cdr entry)) (type-of entry)))))
  (with-session-value-syntax ()
    (prin1-to-string data)))

(defun session-data-from-text (text)
  "The session values TEXT was written from, or NIL and a second value
describing why when TEXT is not such a text (written by another program, or
naming a package this process lacks)."
  (multiple-value-bind (data position)
      (handler-case (with-session-value-syntax ()
                      (read-from-string text))
        (error (condition)
          (return-from session-data-from-text
            (values nil (format nil "unreadable: ~A" (type-of condition))))))
    (cond ((find-if-not (lambda (character) (member character '(#\Space #\Newline #\Tab)))
                        text :start position)
           (values nil "text after the values"))
          ((not (storable-data-p data))
           (values nil "not a list of storable values"))
          (t data))))
