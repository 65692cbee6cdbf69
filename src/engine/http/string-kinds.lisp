;;;; Loops over a string's characters compiled for each kind of simple
;;;; string: the head's parser and handlers give simple strings, and a loop
;;;; over a string of unknown kind reads each character through a generic
;;;; accessor (a FIND-IF over header values cost 4% of a 0 ms request, the
;;;; Host check 3%).

(in-package #:hunchentoot-recycling-taskmaster)

(defmacro with-string-kind ((string) &body body)
  "Run BODY, which loops over the characters of the string in the variable
STRING, with STRING declared the kind of simple string it is: BODY is
compiled once for each kind, and once for any other string."
  `(typecase ,string
     ((simple-array character (*))
      (let ((,string ,string)) (declare (type (simple-array character (*)) ,string)) ,@body))
     (simple-base-string
      (let ((,string ,string)) (declare (type simple-base-string ,string)) ,@body))
     (t ,@body)))

(defun ascii-string-octets (string)
  "The codes of the characters of STRING, all ASCII, as octets."
  (let ((octets (make-array (length string) :element-type '(unsigned-byte 8))))
    (with-string-kind (string)
      (dotimes (index (length string))
        (setf (aref octets index) (char-code (char string index)))))
    octets))

(defun string-occurs-p (part string)
  "True when the string PART occurs in STRING, case counting, as SEARCH
finds it, over STRING's own kind.  For the server's short PART in a
client's STRING: each character of STRING is compared with PART's first,
and PART whole only where that one matches."
  (let ((part-length (length part))
        (length (length string)))
    (or (zerop part-length)
        (let ((first (char part 0)))
          (with-string-kind (string)
            (loop for start from 0 to (- length part-length)
                  thereis (and (char= (char string start) first)
                               (loop for index from 1 below part-length
                                     always (char= (char string (+ start index)) (char part index))))))))))
