;;;; RFC 6455 frames as octets (section 5): the head of a frame a client
;;;; sent, read straight from a buffer; unmasking its payload in place; the
;;;; frames the server sends; the payload of a close frame.  Pure functions
;;;; of octet buffers, like request-head.lisp, tested without a socket
;;;; (test/websocket-frames.lisp).  What a frame means in the sequence of a
;;;; connection's frames is websocket-reading.lisp's.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +continuation-opcode+ 0)

(defconstant +text-opcode+ 1)

(defconstant +binary-opcode+ 2)

(defconstant +close-opcode+ 8)

(defconstant +ping-opcode+ 9)

(defconstant +pong-opcode+ 10)

(defconstant +max-control-payload-bytes+ 125
  "RFC 6455 5.5: a control frame's payload is at most 125 octets.")

(defun control-opcode-p (opcode)
  "True for the opcodes of control frames (close, ping, pong and the
reserved ones from 11)."
  (>= opcode 8))

(defun known-opcode-p (opcode)
  (member opcode '(0 1 2 8 9 10)))

;;; The head of a client's frame.

(defun frame-compressed-p (buffer start)
  "True when the frame whose head begins at START in BUFFER has RSV1 set:
with permessage-deflate, the first frame of a compressed message."
  (logbitp 6 (aref buffer start)))

(defun parse-frame-head (buffer start end &optional deflate-p)
  "Read the head of a client's frame from BUFFER at START, the octets that
have arrived ending at END.  Returns :INCOMPLETE when the head has not all
arrived; 1002 (the close code of a protocol error) when the head is
refused -- a reserved bit set (but RSV1 on the first frame of a message
when DEFLATE-P, permessage-deflate negotiated), a reserved
opcode, an unmasked frame, a control frame fragmented or over 125 octets, a
64-bit length with its top bit set; else :COMPLETE, whether it is the last
frame of its message, its opcode, its payload length, its masking key as
an integer (the four octets big-endian), and the position of its payload."
  (declare (type octets buffer) (type fixnum start end))
  (when (< (- end start) 2)
    (return-from parse-frame-head :incomplete))
  (let* ((first (aref buffer start))
         (second (aref buffer (1+ start)))
         (fin-p (logbitp 7 first))
         (opcode (ldb (byte 4 0) first))
         (short-length (ldb (byte 7 0) second))
         (length-octets (case short-length (126 2) (127 8) (t 0)))
         (head-end (+ start 2 length-octets 4)))
    (cond ((or (plusp (ldb (byte 2 4) first))
               (and (logbitp 6 first)
                    (not (and deflate-p (member opcode (list +text-opcode+ +binary-opcode+)))))
               (not (known-opcode-p opcode))
               (not (logbitp 7 second))
               (and (control-opcode-p opcode)
                    (or (not fin-p) (> short-length +max-control-payload-bytes+))))
           1002)
          ((< end head-end) :incomplete)
          (t
           (let ((length (if (zerop length-octets)
                             short-length
                             (loop with value = 0
                                   for index from (+ start 2) below (+ start 2 length-octets)
                                   do (setf value (logior (ash value 8) (aref buffer index)))
                                   finally (return value))))
                 (mask (loop with value = 0
                             for index from (- head-end 4) below head-end
                             do (setf value (logior (ash value 8) (aref buffer index)))
                             finally (return value))))
             (if (logbitp 63 length)
                 1002
                 (values :complete fin-p opcode length mask head-end)))))))

(defun unmask-octets (buffer start end mask phase)
  "Unmask, in place, the octets of BUFFER from START below END, which are
a frame's payload from its octet PHASE on (RFC 6455 5.3): each is XORed
with the octet of the masking key MASK at its position modulo 4."
  (declare (type octets buffer) (type fixnum start end phase) (type (unsigned-byte 32) mask)
           (optimize speed))
  (loop for index of-type fixnum from start below end
        for key-index of-type fixnum = (logand (+ phase (- index start)) 3)
        do (setf (aref buffer index)
                 (logxor (aref buffer index)
                         (ldb (byte 8 (* 8 (- 3 key-index))) mask))))
  buffer)

;;; The frames the server sends: whole messages, never masked.

(defun frame-head-length (payload-length)
  (cond ((<= payload-length 125) 2)
        ((<= payload-length #xFFFF) 4)
        (t 10)))

(defun write-frame-head (frame opcode length &optional (start 0) compressed-p)
  "Write the head of a final frame of OPCODE carrying LENGTH octets into
FRAME at START, with RSV1 set when COMPRESSED-P (a permessage-deflate
message); the position its payload begins at."
  (declare (type octets frame) (type fixnum start))
  (let ((head-length (frame-head-length length)))
    (setf (aref frame start) (logior #x80 (if compressed-p #x40 0) opcode))
    (case head-length
      (2 (setf (aref frame (+ start 1)) length))
      (4 (setf (aref frame (+ start 1)) 126
               (aref frame (+ start 2)) (ldb (byte 8 8) length)
               (aref frame (+ start 3)) (ldb (byte 8 0) length)))
      (t (setf (aref frame (+ start 1)) 127)
         (loop for index from 2 below 10
               do (setf (aref frame (+ start index)) (ldb (byte 8 (* 8 (- 9 index))) length)))))
    (+ start head-length)))

(defun frame-octets (opcode payload &key (start 0) (end (length payload)))
  "A final frame of OPCODE carrying the octets of PAYLOAD from START below
END, head and payload in one fresh vector, so that it leaves in one
send(2)."
  (declare (type octets payload) (type fixnum start end))
  (let* ((length (- end start))
         (frame (make-array (+ (frame-head-length length) length) :element-type '(unsigned-byte 8))))
    (replace frame payload :start1 (write-frame-head frame opcode length) :start2 start :end2 end)
    frame))

;;; Close frames (RFC 6455 5.5.1, 7.4).

(defun sendable-close-code-p (code)
  "True for the close codes a frame may carry: those RFC 6455 7.4.1 defines
for use in a frame, those registered since (1012 to 1014), and the ranges
for libraries and applications (3000 to 4999).  1005, 1006 and 1015 only
ever report a close that had no frame."
  (or (<= 1000 code 1003) (<= 1007 code 1014) (<= 3000 code 4999)))

(defun close-payload (code reason)
  "The payload of a close frame saying CODE (an integer, or NIL for none)
and REASON, a string cut to fit the 125 octets of a control frame."
  (if (null code)
      (make-array 0 :element-type '(unsigned-byte 8))
      (let* ((reason-octets (string-utf-8-octets reason))
             (length (min (length reason-octets) (- +max-control-payload-bytes+ 2)))
             (payload (make-array (+ 2 length) :element-type '(unsigned-byte 8))))
        ;; A cut in the middle of a character would make the reason invalid.
        (loop while (and (plusp length) (< length (length reason-octets))
                         (= (logand (aref reason-octets length) #xC0) #x80))
              do (decf length))
        (setf (aref payload 0) (ldb (byte 8 8) code)
              (aref payload 1) (ldb (byte 8 0) code))
        (replace payload reason-octets :start1 2 :end2 length)
        (subseq payload 0 (+ 2 length)))))

(defun parse-close-payload (payload start end)
  "Read the payload of a close frame, the octets of PAYLOAD from START below
END.  Returns
the code it says (NIL when it is empty) and its reason as a string; or
:REFUSE and the code to fail the connection with: 1002 for one octet or a
code no frame may carry, 1007 for a reason that is not UTF-8."
  (declare (type octets payload) (type fixnum start end))
  (let ((length (- end start)))
    (cond ((zerop length) (values nil ""))
          ((= length 1) (values :refuse 1002))
          (t (let ((code (logior (ash (aref payload start) 8) (aref payload (1+ start)))))
               (cond ((not (sendable-close-code-p code)) (values :refuse 1002))
                     ((not (eql 0 (scan-utf-8 0 payload (+ start 2) end))) (values :refuse 1007))
                     (t (values code (utf-8-octets-string payload (+ start 2) end)))))))))
