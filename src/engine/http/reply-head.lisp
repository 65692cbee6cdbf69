;;;; The octets of a reply's head, built in a buffer each worker keeps: the
;;;; status line and the header lines, written as Hunchentoot's header
;;;; stream writes them but without a flexi-stream or FORMAT per line
;;;; (bench/profiles: a fifth of the samples of a trivial request went
;;;; there), and what START-OUTPUT adds to a reply's headers -- its Date, the
;;;; charset of a text type -- computed once, not once per reply.

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (reply-head (:constructor make-reply-head
                            (&optional (octets (make-array 2048 :element-type '(unsigned-byte 8))))))
  (octets nil :type octets)
  (end 0 :type fixnum)
  ;; The last head built whose every value the engine made or is a number,
  ;; with no cookie and no header left out, kept to be copied whole for the
  ;; next reply of the same return code and headers (REMEMBERED-HEAD-OCTETS):
  ;; its return code (NIL until one is kept), its headers' names and
  ;; values in turn in one vector, and its octets: two objects, which
  ;; PREFETCH-REMEMBERED-HEAD asks into the caches ahead of the compare
  ;; when the worker comes back cold from a handler that waited.
  (remembered-code nil)
  (remembered-entries #() :type simple-vector)
  (remembered-octets nil))

(declaim (inline room-for))
(defun room-for (count head)
  "The octets of HEAD, with room for COUNT more after its end."
  (declare (type reply-head head) (type fixnum count))
  (let ((octets (reply-head-octets head)))
    (if (<= (+ (reply-head-end head) count) (length octets))
        octets
        (the octets (grow-reply-head head count)))))

(defun grow-reply-head (head count)
  "Make HEAD's octets longer, to take COUNT more after its end; the new octets."
  (declare (type reply-head head) (type fixnum count))
  (let ((octets (reply-head-octets head)))
    (setf (reply-head-octets head)
          (replace (make-array (max (+ (reply-head-end head) count) (* 2 (length octets)))
                               :element-type '(unsigned-byte 8))
                   octets :end2 (reply-head-end head)))))

;;; The pushers are inlined, each taking its range as positional arguments:
;;; called a few dozen times for every reply, their calls and keyword
;;; parsing were a tenth of a 0 ms request.

(declaim (inline push-octet))
(defun push-octet (octet head)
  (declare (type reply-head head) (type (unsigned-byte 8) octet))
  (let ((octets (room-for 1 head)))
    (setf (aref octets (reply-head-end head)) octet)
    (incf (reply-head-end head))))

(defun push-octets (octets head)
  (declare (type octets octets) (type reply-head head) (optimize speed))
  (let ((end (reply-head-end head))
        (count (length octets)))
    (replace (room-for count head) octets :start1 end)
    (setf (reply-head-end head) (+ end count))))

(declaim (inline unsafe-header-char-p))
(defun unsafe-header-char-p (char)
  ;; One comparison for the characters of common text, all above CR.
  (let ((code (char-code char)))
    (and (<= code 13) (or (= code 13) (= code 10) (= code 0)))))

(defun push-text (string head)
  "Push the characters of STRING as Latin-1 octets, as Hunchentoot's header
stream writes them; a character outside Latin-1 as ?.  True when STRING has
a CR, LF or NUL (UNSAFE-HEADER-CHAR-P), found as it is copied."
  (declare (type string string) (type reply-head head))
  (let* ((end (length string))
         (octets (room-for end head))
         (position (reply-head-end head))
         (unsafe-p nil))
    (declare (type fixnum position))
    (with-string-kind (string)
      (dotimes (index end)
        (let ((char (char string index)))
          (when (unsafe-header-char-p char)
            (setf unsafe-p t))
          (let ((code (char-code char)))
            (setf (aref octets position) (if (< code 256) code 63))))
        (incf position)))
    (setf (reply-head-end head) position)
    unsafe-p))

(defun push-decimal (integer head)
  "Push the decimal digits of the non-negative INTEGER, consing nothing."
  (declare (type (integer 0) integer))
  (if (< integer 10)
      (push-octet (+ 48 integer) head)
      (multiple-value-bind (rest digit) (floor integer 10)
        (push-decimal rest head)
        (push-octet (+ 48 digit) head))))

(declaim (inline push-crlf))
(defun push-crlf (head)
  (let ((octets (room-for 2 head))
        (end (reply-head-end head)))
    (setf (aref octets end) +cr+
          (aref octets (1+ end)) +lf+
          (reply-head-end head) (+ end 2))))

(defun header-line-start (name)
  "The octets of NAME, a keyword, as Hunchentoot writes a reply header's
name (CHUNGA:AS-CAPITALIZED-STRING), and the colon and space after it."
  (map 'octets #'char-code (format nil "~A: " (chunga:as-capitalized-string name))))

(defmacro header-line-starts-case (name &rest names)
  "The HEADER-LINE-START of NAME when it is one of NAMES, made once, at
load; else NIL."
  `(case ,name
     ,@(loop for known in names
             collect `(,known (load-time-value (header-line-start ,known) t)))
     (t nil)))

(defun push-header-name (name head)
  "Push the header name NAME, a keyword (see HEADER-LINE-START) or a string,
then a colon and a space.  The names every reply has are copied from octets
made once, not spelled (Chunga looks them up in a hash table) and copied
character by character at each reply."
  (let ((start (header-line-starts-case name :content-length :content-type :date :server :connection :keep-alive)))
    (if start
        (push-octets start head)
        (progn (push-text (if (stringp name) name (chunga:as-capitalized-string name)) head)
               (push-octet #.(char-code #\:) head)
               (push-octet #.(char-code #\Space) head)))))

(defun push-header-line (name value head &optional value-octets)
  "Push the header line NAME: VALUE (NAME as PUSH-HEADER-NAME takes it),
VALUE as Hunchentoot writes it: a number in decimal, anything but a string
as PRINC writes it; VALUE-OCTETS, when given, are VALUE's as
HEADER-TEXT-OCTETS made them.  True when VALUE has a CR, LF or NUL, and the
line is then not one to send (REFUSE-UNSAFE-HEADER-VALUES)."
  (push-header-name name head)
  (prog1 (cond (value-octets (push-octets value-octets head) nil)
               ((typep value '(integer 0)) (push-decimal value head) nil)
               (t (push-text (header-text value) head)))
    (push-crlf head)))

(defun header-text-octets (text)
  "The octets PUSH-TEXT writes TEXT as, a fresh vector of just their
length; NIL when TEXT has a CR, LF or NUL."
  (let ((head (make-reply-head (make-array (length text) :element-type '(unsigned-byte 8)))))
    (unless (push-text text head)
      (reply-head-octets head))))

;;; A head copied whole.

(defun remembered-head-octets (head return-code headers)
  "The octets of the head HEAD last kept (REMEMBER-HEAD) when it was built
of RETURN-CODE and a headers alist of the same names and values, in the
same order, as HEADERS; else NIL.  The values are compared by EQL: kept
heads have only numbers and strings the engine made and never changes."
  (declare (type reply-head head))
  (let ((entries (reply-head-remembered-entries head))
        (index 0))
    (declare (type fixnum index))
    (and (eql return-code (reply-head-remembered-code head))
         (loop for (name . value) in headers
               always (and (< index (length entries))
                           (eq name (svref entries index))
                           (eql value (svref entries (1+ index))))
               do (incf index 2))
         (= index (length entries))
         (reply-head-remembered-octets head))))

(defun remember-head (head return-code headers)
  "Keep the head just built in HEAD, of RETURN-CODE and HEADERS, to be
copied whole for the next reply REMEMBERED-HEAD-OCTETS finds the same."
  (declare (type reply-head head))
  (setf (reply-head-remembered-code head) return-code
        (reply-head-remembered-entries head) (loop with entries = (make-array (* 2 (length headers)))
                                                   for (name . value) in headers
                                                   for index from 0 by 2
                                                   do (setf (svref entries index) name
                                                            (svref entries (1+ index)) value)
                                                   finally (return entries))
        (reply-head-remembered-octets head) (subseq (reply-head-octets head) 0 (reply-head-end head))))

(defun prefetch-remembered-head (head)
  "Ask the caches for HEAD's kept head (REMEMBER-HEAD) without waiting: a
worker back from a handler that slept finds it evicted by the other
workers, and the compare then waited on memory (2.4% of the user time a
request at 1 ms, 1,000 connections; bench/profiles/2026-12-04-remembered-heads.txt)."
  (declare (type reply-head head))
  ;; Their lengths are not read: that would wait for them.  A common head
  ;; has 7 entries (128 octets) and some 200 octets.
  (prefetch-octets (reply-head-remembered-entries head) 128)
  (prefetch-octets (reply-head-remembered-octets head) 256))

;;; Header values that would end their line early.

(defun header-text (value)
  "The text a header's VALUE is written as."
  (if (stringp value) value (princ-to-string value)))

(defun unsafe-header-text-p (text)
  "True when TEXT has a CR, LF or NUL: written in a header, the line would
end there and the rest read as another header or the body (RFC 9112 2.2)."
  (declare (type string text))
  (with-string-kind (text)
    (loop for char across text thereis (unsafe-header-char-p char))))

(defun refuse-unsafe-header-values (reply)
  "Signal HEADER-VALUE-REFUSED for the first of REPLY's headers or cookies
whose value is unsafe (UNSAFE-HEADER-TEXT-P), after taking it out of REPLY
and marking the headers unsent, so that the 500 the request gets instead
can be written.  Takes only REPLY, so that a backtrace of the error shows
no header's value."
  ;; DOLIST binds ENTRY afresh at each turn, so that a closure over it is
  ;; made only when a value is refused: over LOOP's variables, which are
  ;; assigned, every call would cons a cell for each.
  (flet ((refuse (name remove)
           (setf (headers-sent-p) nil)
           (funcall remove)
           (error 'header-value-refused :name name)))
    (dolist (entry (reply-headers reply))
      (let ((value (cdr entry)))
        (when (and value (not (integerp value)) (unsafe-header-text-p (header-text value)))
          (refuse (chunga:as-capitalized-string (car entry))
                  (lambda () (setf (hunchentoot:header-out (car entry) reply) nil))))))
    (dolist (entry (hunchentoot:cookies-out reply))
      (when (unsafe-header-text-p (cookie-header-value (cdr entry)))
        (refuse "Set-Cookie"
                (lambda () (setf (hunchentoot:cookies-out reply)
                                 (remove entry (hunchentoot:cookies-out reply)))))))))

;;; Status lines.

(defun make-status-line (return-code)
  (map 'octets #'char-code (format nil "HTTP/1.1 ~D ~A~C~C" return-code (hunchentoot:reason-phrase return-code)
                                   #\Return #\Linefeed)))

(defparameter *status-lines*
  (let ((lines (make-array 600 :initial-element nil)))
    (loop for return-code from 100 below 600
          do (setf (svref lines return-code) (make-status-line return-code)))
    lines)
  "The status line of each return code from 100 to 599, as octets.")

(defun status-line (return-code)
  (if (and (integerp return-code) (<= 100 return-code 599))
      (svref *status-lines* return-code)
      (make-status-line return-code)))

;;; What START-OUTPUT would compute anew for every reply.

(defvar *date-header* (list 0 "" (header-text-octets ""))
  "Until when the last Date header made holds (internal real time, when the
next second begins), its value and the value's octets: one formatted per
second, not per reply.")

(defun date-header-value ()
  "The Date header value of this second, as Hunchentoot's RFC-1123-DATE
writes it.  A reply reads SBCL's coarse clock (6 ns), not the time of day
(24 ns, 1% of a kept-alive request's user time), to tell whether the second
has passed: the value may be a tick of that clock (4 ms here) late, as
nginx's is by the turn of its event loop."
  (let ((cache *date-header*)
        (now (get-internal-real-time)))
    (if (< now (first cache))
        (second cache)
        (multiple-value-bind (universal-time microseconds) (universal-time-and-microseconds)
          (let ((value (hunchentoot:rfc-1123-date universal-time)))
            (setf *date-header* (list (+ now (ceiling (* (- 1000000 microseconds) internal-time-units-per-second)
                                                      1000000))
                                      value (header-text-octets value)))
            value)))))

(defun date-header-octets (value)
  "The octets of VALUE when it is the Date header value DATE-HEADER-VALUE
returns now; else NIL."
  (let ((cache *date-header*))
    (and (eq value (second cache)) (third cache))))

(defun charset-parameter-p (content-type)
  "True when CONTENT-TYPE has a charset parameter: a ; then optional
whitespace then charset=, in any case."
  (loop for semicolon = (position #\; content-type) then (position #\; content-type :start (1+ semicolon))
        while semicolon
        thereis (let ((start (or (position-if-not (lambda (char) (member char '(#\Space #\Tab)))
                                                  content-type :start (1+ semicolon))
                                 (length content-type))))
                  (and (<= (+ start 8) (length content-type))
                       (string-equal "charset=" content-type :start2 start :end2 (+ start 8))))))

;;; Answers asked for again and again: handlers set the same literal
;;; content type, use the same external format, at every request.

(defmacro remembering-last-answer ((place &rest keys) &body body)
  "BODY's value for KEYS: the answer kept in PLACE when KEYS are, by EQ, the
keys of the last time, else BODY's, kept there.  PLACE holds a list of the
keys and the answer, replaced whole, so that any thread reads one answer
with its own keys."
  (let ((last (gensym "LAST"))
        (answer (gensym "ANSWER"))
        (key-variables (loop repeat (length keys) collect (gensym "KEY"))))
    `(let ((,last ,place)
           ,@(mapcar #'list key-variables keys))
       (if (and ,@(loop for variable in key-variables
                        for index from 0
                        collect `(eq ,variable (nth ,index ,last))))
           (nth ,(length keys) ,last)
           (let ((,answer (progn ,@body)))
             (setf ,place (list ,@key-variables ,answer))
             ,answer)))))

(defvar *content-type-with-charset* (list nil nil nil)
  "The last content type and external format the charset was added for, and
the result with its octets when the charset was added (else NIL): handlers
set the same literal content type again and again.")

(defun content-type-with-charset (content-type external-format)
  "CONTENT-TYPE with the charset of EXTERNAL-FORMAT added if it is a text
type without one, as Hunchentoot adds it to a string body's type."
  (car (remembering-last-answer (*content-type-with-charset* content-type external-format)
         (if (and (<= 4 (length content-type))
                  (string-equal "text" content-type :end2 4)
                  (not (charset-parameter-p content-type)))
             (let ((made (format nil "~A; charset=~(~A~)" content-type (flex:external-format-name external-format))))
               (cons made (header-text-octets made)))
             (cons content-type nil)))))

(defun charset-added-content-type-octets (value)
  "The octets of VALUE when it is the content type CONTENT-TYPE-WITH-CHARSET
last made, adding the charset; else NIL."
  (let ((answer (third *content-type-with-charset*)))
    (and (eq value (car answer)) (cdr answer))))
