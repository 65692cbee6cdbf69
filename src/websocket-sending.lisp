;;;; Sending to a websocket client, from any thread: a handler of its own
;;;; or another client's message, a thread of the application's.  Nothing
;;;; here waits on the client: what its socket does not take waits with its
;;;; connection (engine/readiness/outbox.lisp, "Sending from
;;;; any thread").

(in-package #:hunchentoot-recycling-taskmaster)

(defvar *last-message-frame* nil
  "The frame of the last message sent, as (MESSAGE . COUNTED-OCTETS),
holding it once: a send of the same MESSAGE object, its content unchanged,
shares that frame instead of making another, so that a broadcast costs
its message once however many clients it goes to.")

(defun message-payload-length (opcode message)
  (if (= opcode +text-opcode+) (utf-8-length message) (length message)))

(defun make-message-frame (opcode message budget)
  "A frame of OPCODE carrying MESSAGE (a simple string for text, octets
for binary) as COUNTED-OCTETS held once, taken from BUDGET before it is
made; NIL when BUDGET has no room."
  (let* ((length (message-payload-length opcode message))
         (frame (make-counted-octets budget (+ (frame-head-length length) length))))
    (when frame
      (let* ((octets (counted-octets-octets frame))
             (start (write-frame-head octets opcode length)))
        (if (= opcode +text-opcode+)
            (encode-utf-8-into message octets start)
            (replace octets message :start1 start))))
    frame))

(defun frame-carries-p (frame opcode message)
  "True when FRAME, COUNTED-OCTETS, is the frame of OPCODE carrying MESSAGE as it is now."
  (let* ((octets (counted-octets-octets frame))
         (length (length octets)))
    (and (>= length 2)
         (= (logand (aref octets 0) #x0F) opcode)
         (let ((start (- length (message-payload-length opcode message))))
           (and (= start (frame-head-length (- length start)))
                (if (= opcode +text-opcode+)
                    (utf-8-encodes-p message octets start)
                    (not (mismatch octets message :start1 start))))))))

(defun message-frame (opcode message budget)
  "The frame of OPCODE carrying MESSAGE as COUNTED-OCTETS held once for the
caller: the last message's frame when MESSAGE is that message unchanged,
else a new one from BUDGET; NIL when BUDGET has no room."
  (let ((last *last-message-frame*))
    (if (and last (eq (car last) message)
             (frame-carries-p (cdr last) opcode message)
             (hold-counted-octets (cdr last)))
        (cdr last)
        (let ((frame (make-message-frame opcode message budget)))
          (when (and frame (hold-counted-octets frame))
            (let ((old (loop for old = *last-message-frame*
                             until (compare-and-swap (symbol-value '*last-message-frame*) old (cons message frame))
                             finally (return old))))
              (when old
                (let-go-of-counted-octets (cdr old)))))
          frame))))

(defconstant +websocket-deflate-level+ 1
  "The deflate level of the messages the server compresses: the fastest,
as most messages are short and sent to many.")

(defconstant +idle-deflaters+ 8
  "The most raw deflate streams kept between sends for the next; a thread
that finds none makes one.")

(defvar *idle-deflaters* '()
  "Raw deflate streams no send is using, as (WINDOW-BITS . STREAM).")

(defvar *idle-deflaters-lock* (bt:make-lock "idle deflaters"))

(defun deflated-payload (octets window-bits)
  "OCTETS as a permessage-deflate message carries them, deflated with a
window of WINDOW-BITS by a deflate stream of *IDLE-DEFLATERS* or a new one,
from any thread."
  (let ((deflater (bt:with-lock-held (*idle-deflaters-lock*)
                    (let ((entry (find window-bits *idle-deflaters* :key #'car)))
                      (when entry
                        (setf *idle-deflaters* (remove entry *idle-deflaters* :count 1 :test #'eq))
                        (cdr entry))))))
    (unless deflater
      (setf deflater (make-raw-deflate-stream +websocket-deflate-level+ window-bits)))
    (unwind-protect (raw-deflate-message deflater octets)
      (unless (bt:with-lock-held (*idle-deflaters-lock*)
                (when (< (length *idle-deflaters*) +idle-deflaters+)
                  (push (cons window-bits deflater) *idle-deflaters*)))
        (free-gzip-stream deflater)))))

(defvar *last-deflated-frame* nil
  "The compressed frame of the last message compressed, as (MESSAGE
WINDOW-BITS PAYLOAD COUNTED-OCTETS), PAYLOAD its octets before
compression: a send of the same MESSAGE, unchanged, to a client with the
same window shares the frame, as *LAST-MESSAGE-FRAME* shares plain ones.")

(defun message-octets-of (opcode message)
  (if (= opcode +text-opcode+) (string-utf-8-octets message) message))

(defun payload-of-p (payload opcode message)
  "True when PAYLOAD is the octets of MESSAGE, of OPCODE, as it is now."
  (and (= (length payload) (message-payload-length opcode message))
       (if (= opcode +text-opcode+)
           (utf-8-encodes-p message payload 0)
           (not (mismatch payload message)))))

(defun deflated-message-frame (opcode message window-bits budget)
  "The frame of OPCODE carrying MESSAGE compressed with WINDOW-BITS, as
COUNTED-OCTETS held once for the caller, shared with the last send of the
same message unchanged; NIL when BUDGET has no room."
  (let ((last *last-deflated-frame*))
    (destructuring-bind (&optional last-message last-bits last-payload last-frame) last
      (if (and last (eq last-message message) (eql last-bits window-bits)
               (payload-of-p last-payload opcode message)
               (hold-counted-octets last-frame))
          last-frame
          (let* ((payload (message-octets-of opcode message))
                 (deflated (deflated-payload payload window-bits))
                 (frame (make-counted-octets budget (+ (frame-head-length (length deflated)) (length deflated)))))
            (when frame
              (let ((octets (counted-octets-octets frame)))
                (replace octets deflated :start1 (write-frame-head octets opcode (length deflated) 0 t)))
              (when (hold-counted-octets frame)
                (let ((old (loop for old = *last-deflated-frame*
                                 until (compare-and-swap (symbol-value '*last-deflated-frame*) old
                                                         (list message window-bits
                                                               (if (= opcode +text-opcode+) payload (copy-seq payload))
                                                               frame))
                                 finally (return old))))
                  (when old
                    (let-go-of-counted-octets (fourth old))))))
            frame)))))

(defun forget-idle-message-frames ()
  "Let go of the frames *LAST-MESSAGE-FRAME* and *LAST-DEFLATED-FRAME* keep
when no queue holds them any more: kept for the next send of their
message, they are counted in a memory budget, which is to hold nothing
once nothing is open."
  (flet ((forget (symbol frame-of)
           (let ((entry (symbol-value symbol)))
             (when (and entry (= 1 (counted-octets-holders (funcall frame-of entry)))
                        (compare-and-swap (symbol-value symbol) entry nil))
               (let-go-of-counted-octets (funcall frame-of entry))))))
    (forget '*last-message-frame* #'cdr)
    (forget '*last-deflated-frame* #'fourth)))

;;; Kept frames are let go of at every maintenance once idle, and at the
;;; end of a run, whose connections, closed, hold none.
(defmethod engine-maintain :after ((engine readiness-engine))
  (forget-idle-message-frames))

(defmethod engine-finish :after ((engine readiness-engine))
  (forget-idle-message-frames))

(defmethod engine-abandon :after ((engine readiness-engine))
  (forget-idle-message-frames))

(defun websocket-frame (websocket opcode message budget)
  "The frame of OPCODE carrying MESSAGE for WEBSOCKET: compressed when
permessage-deflate was agreed and the message is a text or binary one of
at least the acceptor's :COMPRESSION-MIN-BYTES, else plain."
  (let ((window-bits (websocket-deflate-window-bits websocket)))
    (if (and window-bits
             (member opcode (list +text-opcode+ +binary-opcode+))
             (>= (message-payload-length opcode message)
                 (acceptor-compression-min-bytes (websocket-acceptor websocket))))
        (deflated-message-frame opcode message window-bits budget)
        (message-frame opcode message budget))))

(defun send-message-to-client (client opcode message)
  "Send CLIENT a frame of OPCODE carrying MESSAGE (a simple string for
text, octets for binary).  True when it is sent or waits to be; NIL when
CLIENT is closing or closed, or the frame does not fit what may wait for it
or the memory budget (the client is then closed, with 1008 or 1013)."
  (let ((websocket (client-websocket client)))
    (when (and websocket (websocket-open-p websocket))
      (let* ((frame (websocket-frame websocket opcode message (readiness-set-memory-budget (websocket-set websocket))))
             (offered (if frame
                          (offer-outbox-octets websocket frame)
                          (refuse-outbox-send websocket 1013))))
        (when frame
          ;; The queue holds it now, if it took it.
          (let-go-of-counted-octets frame))
        (when offered
          (atomic-increment (connection-counters-websocket-messages-out (websocket-counters websocket))))
        ;; Not for a send dropped because the websocket is closing: parking
        ;; it again would put off the end of its wait for the close.
        (when (or offered (websocket-refusal-code websocket))
          (serve-outbox-output websocket))
        offered))))

(defun ws:send-text-message (client message)
  "Send CLIENT the text MESSAGE, a string, from any thread, without
waiting.  True when it is sent or waits for the client's socket to take
it; NIL when CLIENT is closing or closed, when the octets waiting for it
would pass the acceptor's :MAX-WEBSOCKET-QUEUE-BYTES (then CLIENT is
closed with 1008), or when the acceptor's memory budget has no room for
the frame (then CLIENT is closed with 1013).  Sending one string to many
clients, as a broadcast does, encodes it once: they share its frame."
  (check-type message string)
  (send-message-to-client client +text-opcode+ (if (simple-string-p message) message (coerce message 'simple-string))))

(defun ws:send-binary-message (client octets)
  "Send CLIENT the binary message OCTETS, a vector of octets, as
SEND-TEXT-MESSAGE sends text."
  (send-message-to-client client +binary-opcode+ (if (typep octets 'octets) octets (coerce octets 'octets))))

(defun ws:send-ping (client &optional (payload #()))
  "Send CLIENT a ping carrying PAYLOAD (at most 125 octets).  The engine
pings silent clients by itself (:WEBSOCKET-PING-INTERVAL)."
  (let ((octets (coerce payload 'octets)))
    (assert (<= (length octets) +max-control-payload-bytes+) (payload)
            "A ping carries at most ~D octets." +max-control-payload-bytes+)
    (send-message-to-client client +ping-opcode+ octets)))

(defun ws:close-connection (client &key (status 1000) (reason ""))
  "Close CLIENT's websocket with STATUS, a close code, and REASON, from any
thread: what was sent to it before goes first, then the close frame; the
connection ends when the client answers with its own, or after 5 s."
  (assert (sendable-close-code-p status) (status) "~S is not a close code a frame may carry." status)
  (let ((websocket (client-websocket client)))
    (when (and websocket (websocket-open-p websocket))
      (setf (websocket-close-requested websocket) (list status reason))
      (serve-outbox-output websocket))))

(defun ws:client-open-p (client)
  "True while CLIENT's websocket is open: messages sent to it are sent."
  (let ((websocket (client-websocket client)))
    (and websocket (websocket-open-p websocket))))

;;; A resource that takes no messages of a kind.

(defmethod ws:text-message-received ((resource ws:websocket-resource) client message)
  (declare (ignore message))
  (ws:close-connection client :status 1003 :reason "No text here"))

(defmethod ws:binary-message-received ((resource ws:websocket-resource) client octets)
  (declare (ignore octets))
  (ws:close-connection client :status 1003 :reason "No binary here"))
