;;;; UTF-8 as RFC 6455 wants it checked (8.1): a text message is refused
;;;; with 1007 as soon as its octets cannot be UTF-8 -- not only at its end,
;;;; so that the octets are checked fragment by fragment, as they arrive,
;;;; with a state carried from one piece to the next.  Overlong forms,
;;;; surrogates and code points past U+10FFFF are not UTF-8 (RFC 3629).

(in-package #:hunchentoot-recycling-taskmaster)

(declaim (inline utf-8-state))
(defun utf-8-state (needed lower upper)
  "The state of a character begun with NEEDED octets still to come, the
next one from LOWER to UPPER."
  (logior (ash needed 16) (ash lower 8) upper))

(defun scan-utf-8 (state octets start end)
  "Go on checking a text whose octets so far left STATE (0 at its start or
between characters) over the OCTETS from START below END.  The new state:
0 when they end between characters, a positive integer in the middle of
one; NIL as soon as an octet cannot be UTF-8 there."
  (declare (type fixnum state start end) (type octets octets) (optimize speed))
  (loop for index of-type fixnum from start below end
        for octet of-type (unsigned-byte 8) = (aref octets index)
        do (if (zerop state)
               (cond ((< octet #x80))
                     ((<= #xC2 octet #xDF) (setf state (utf-8-state 1 #x80 #xBF)))
                     ((= octet #xE0) (setf state (utf-8-state 2 #xA0 #xBF)))
                     ((= octet #xED) (setf state (utf-8-state 2 #x80 #x9F)))
                     ((<= #xE1 octet #xEF) (setf state (utf-8-state 2 #x80 #xBF)))
                     ((= octet #xF0) (setf state (utf-8-state 3 #x90 #xBF)))
                     ((<= #xF1 octet #xF3) (setf state (utf-8-state 3 #x80 #xBF)))
                     ((= octet #xF4) (setf state (utf-8-state 3 #x80 #x8F)))
                     (t (return nil)))
               (let ((needed (ldb (byte 8 16) state)))
                 (unless (<= (ldb (byte 8 8) state) octet (ldb (byte 8 0) state))
                   (return nil))
                 (setf state (if (= needed 1) 0 (utf-8-state (1- needed) #x80 #xBF)))))
        finally (return state)))

(defun utf-8-octets-string (octets start end)
  "The string the UTF-8 OCTETS from START below END encode, checked."
  (sb-ext:octets-to-string octets :start start :end end :external-format :utf-8))

(defun string-utf-8-octets (string)
  (sb-ext:string-to-octets string :external-format :utf-8))

;;; Encoding into a frame made to measure.  A surrogate code point, which
;;; a Lisp string may hold and UTF-8 may not, is encoded as U+FFFD.

(declaim (inline character-utf-8-code))
(defun character-utf-8-code (char)
  (let ((code (char-code char)))
    (if (<= #xD800 code #xDFFF) #xFFFD code)))

(defun utf-8-length (string)
  "The octets of STRING's UTF-8 encoding."
  (declare (type simple-string string) (optimize speed))
  (loop for char across string
        for code = (character-utf-8-code char)
        sum (cond ((< code #x80) 1) ((< code #x800) 2) ((< code #x10000) 3) (t 4)) fixnum))

(defmacro do-utf-8-octets ((octet string) &body body)
  "Run BODY with OCTET bound to each octet of STRING's UTF-8 encoding, in order."
  (let ((code (gensym "CODE")) (char (gensym "CHAR")))
    `(loop for ,char across ,string
           for ,code of-type (integer 0 #x10FFFF) = (character-utf-8-code ,char)
           do (flet ((emit (,octet) ,@body))
                (declare (inline emit))
                (cond ((< ,code #x80) (emit ,code))
                      ((< ,code #x800)
                       (emit (logior #xC0 (ash ,code -6)))
                       (emit (logior #x80 (ldb (byte 6 0) ,code))))
                      ((< ,code #x10000)
                       (emit (logior #xE0 (ash ,code -12)))
                       (emit (logior #x80 (ldb (byte 6 6) ,code)))
                       (emit (logior #x80 (ldb (byte 6 0) ,code))))
                      (t
                       (emit (logior #xF0 (ash ,code -18)))
                       (emit (logior #x80 (ldb (byte 6 12) ,code)))
                       (emit (logior #x80 (ldb (byte 6 6) ,code)))
                       (emit (logior #x80 (ldb (byte 6 0) ,code)))))))))

(defun encode-utf-8-into (string octets start)
  "Write STRING's UTF-8 encoding into OCTETS from START, which has room for it."
  (declare (type simple-string string) (type octets octets) (type fixnum start) (optimize speed))
  (let ((position start))
    (declare (type fixnum position))
    (do-utf-8-octets (octet string)
      (setf (aref octets position) octet)
      (incf position))
    octets))

(defun utf-8-encodes-p (string octets start)
  "True when the OCTETS from START to their end are STRING's UTF-8 encoding."
  (declare (type simple-string string) (type octets octets) (type fixnum start) (optimize speed))
  (let ((position start)
        (end (length octets)))
    (declare (type fixnum position))
    (do-utf-8-octets (octet string)
      (unless (and (< position end) (= octet (aref octets position)))
        (return-from utf-8-encodes-p nil))
      (incf position))
    (= position end)))
