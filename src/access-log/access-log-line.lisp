;;;; An access log entry's octets, as Hunchentoot's ACCEPTOR-LOG-ACCESS
;;;; writes the line (a FORMAT under one global lock, the file opened for
;;;; each line: a third of a kept-alive server's rate, issue 93), built in a
;;;; worker's REPLY-HEAD without FORMAT: its UTF-8 octets, the same octet
;;;; for octet, except for one thing.  A control character from a client (a
;;;; path's %0A decoded, a header's TAB) is written \xHH as nginx writes
;;;; it, so that no client makes what reads as a line of its own or of
;;;; another client; Hunchentoot writes it as it is.

(in-package #:hunchentoot-recycling-taskmaster)

(defvar *access-log-time* (list 0 nil)
  "The internal real time until which the second's time text stays valid,
and its octets: the time of day is formatted once a second.")

(defun access-log-time-octets ()
  "The octets of this second's time as Hunchentoot's entry writes it (its
ISO-TIME), late by a tick of SBCL's coarse clock at most, as the Date header
is (DATE-HEADER-VALUE)."
  (let ((cache *access-log-time*)
        (now (get-internal-real-time)))
    (if (< now (first cache))
        (second cache)
        (multiple-value-bind (universal-time microseconds) (universal-time-and-microseconds)
          (let ((octets (string-utf-8-octets (access-log-time-text universal-time))))
            (setf *access-log-time*
                  (list (+ now (ceiling (* (- 1000000 microseconds) internal-time-units-per-second) 1000000))
                        octets))
            octets)))))

(declaim (inline log-control-char-p))
(defun log-control-char-p (code)
  (or (< code 32) (= code 127)))

(declaim (inline put-utf-8))
(defun put-utf-8 (code octets position)
  "Put the UTF-8 octets of the code point CODE into OCTETS at POSITION,
which has room for them; the position after them."
  (declare (type (integer 0 #x10FFFF) code) (type octets octets) (type fixnum position))
  (flet ((put (octet)
           (setf (aref octets position) octet)
           (incf position)))
    (declare (inline put))
    (cond ((< code #x80) (put code))
          ((< code #x800)
           (put (logior #xC0 (ash code -6)))
           (put (logior #x80 (ldb (byte 6 0) code))))
          ((< code #x10000)
           (put (logior #xE0 (ash code -12)))
           (put (logior #x80 (ldb (byte 6 6) code)))
           (put (logior #x80 (ldb (byte 6 0) code))))
          (t
           (put (logior #xF0 (ash code -18)))
           (put (logior #x80 (ldb (byte 6 12) code)))
           (put (logior #x80 (ldb (byte 6 6) code)))
           (put (logior #x80 (ldb (byte 6 0) code)))))
    position))

(defun push-log-text (string head)
  "Push STRING's UTF-8 octets, each control character as \\xHH."
  (declare (type simple-string string) (type reply-head head) (optimize speed))
  (let ((octets (room-for (* 4 (length string)) head))
        (position (reply-head-end head)))
    (declare (type fixnum position))
    (loop for char across string
          for code of-type (integer 0 #x10FFFF) = (character-utf-8-code char)
          do (if (log-control-char-p code)
                 ;; Four octets for one character: room was made for four.
                 (setf (aref octets position) 92
                       (aref octets (+ position 1)) 120
                       (aref octets (+ position 2)) (char-code (char "0123456789ABCDEF" (ash code -4)))
                       (aref octets (+ position 3)) (char-code (char "0123456789ABCDEF" (logand code 15)))
                       position (+ position 4))
                 (setf position (put-utf-8 code octets position))))
    (setf (reply-head-end head) position)))

(defun push-log-ascii (string head)
  "Push STRING, ASCII the engine wrote (no client's), as its octets."
  (loop for char across string
        do (push-octet (char-code char) head)))

(defun push-log-value (value head)
  "Push VALUE as FORMAT's ~A writes it: a string's characters, a symbol's
name (a request method or protocol, a keyword), a number's digits."
  (typecase value
    (simple-string (push-log-text value head))
    (string (push-log-text (coerce value 'simple-string) head))
    ((integer 0) (push-decimal value head))
    (symbol (push-log-text (symbol-name value) head))
    (t (push-log-text (princ-to-string value) head))))

(defun push-log-value-or-dash (value head)
  "Push VALUE (PUSH-LOG-VALUE), or - when it is NIL."
  (if value (push-log-value value head) (push-octet 45 head)))

(defun push-access-log-line (head remote-addr forwarded-for user time-octets method script-name query-string
                             protocol return-code content-length referer user-agent)
  "Push the access log entry of a request, its newline included, as
Hunchentoot's ACCEPTOR-LOG-ACCESS writes it from these values:

  REMOTE-ADDR (FORWARDED-FOR) USER [TIME] \"METHOD SCRIPT-NAME?QUERY-STRING PROTOCOL\" RETURN-CODE CONTENT-LENGTH \"REFERER\" \"USER-AGENT\"

each of REMOTE-ADDR, USER, CONTENT-LENGTH, REFERER and USER-AGENT written -
when NIL, the parenthesis and the ?QUERY-STRING left out when NIL; TIME-OCTETS
are the time's (ACCESS-LOG-TIME-OCTETS)."
  (push-log-value-or-dash remote-addr head)
  (when forwarded-for
    (push-log-ascii " (" head)
    (push-log-value forwarded-for head)
    (push-octet 41 head))
  (push-octet 32 head)
  (push-log-value-or-dash user head)
  (push-log-ascii " [" head)
  (push-octets time-octets head)
  (push-log-ascii "] \"" head)
  (push-log-value method head)
  (push-octet 32 head)
  (push-log-value script-name head)
  (when query-string
    (push-octet 63 head)
    (push-log-value query-string head))
  (push-octet 32 head)
  (push-log-value protocol head)
  (push-log-ascii "\" " head)
  (push-log-value return-code head)
  (push-octet 32 head)
  (push-log-value-or-dash content-length head)
  (push-log-ascii " \"" head)
  (push-log-value-or-dash referer head)
  (push-log-ascii "\" \"" head)
  (push-log-value-or-dash user-agent head)
  (push-octet 34 head)
  (push-octet 10 head))
