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
