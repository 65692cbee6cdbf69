;;;; A connection that has become a websocket: what the engine keeps of it
;;;; between frames, its outbox of frames (outbox.lisp, "Sending from any
;;;; thread"), and how it waits in the readiness set -- for the client's
;;;; next octets, for room in its socket, for the time to ping it.  Its
;;;; frames are read by engine/serving/websocket-turn.lisp.
;;;;
;;;; These functions never close the connection: they say when the caller
;;;; is to (CLOSE-CONNECTION, closing.lisp, ends the websocket).

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +websocket-closing-seconds+ 5
  "Seconds a websocket that sent its close frame waits for the client's.")

(defstruct (websocket (:include outbox) (:constructor %make-websocket))
  "What the engine keeps of a connection that is a websocket; its STATE is
:CLOSING once its close frame is sent and the client's is awaited, and its
REFUSAL-CODE a close code."
  ;; The acceptor it was opened on, for its limits and its log.
  (acceptor nil :read-only t)
  (resource nil :read-only t)
  (client nil :read-only t)
  ;; The code it closes with: the client's, or the engine's reason.  NIL
  ;; while open; CLOSE-CONNECTION takes 1001 (going away) then.
  (close-code nil)
  (close-reason "")
  ;; True once the close frame has been sent.
  (close-sent-p nil)
  ;; Set by a thread asking for the close (WS:CLOSE-CONNECTION): the code
  ;; and reason the holder closes with.
  (close-requested nil)
  ;; Where the turns are in reading the client's frames: serving's
  ;; (websocket-turn.lisp), kept here between turns, never read here.
  (reader nil :read-only t)
  ;; The window bits of the messages the server compresses
  ;; (permessage-deflate), or NIL when it was not agreed.
  (deflate-window-bits nil :read-only t)
  ;; Times, from the acceptor: internal time units.
  (ping-interval 0 :type fixnum :read-only t)
  (timeout 0 :type fixnum :read-only t)
  (message-timeout 0 :type fixnum :read-only t)
  ;; Internal real time the client last sent anything, and whether it has
  ;; been pinged since.
  (last-heard 0 :type fixnum)
  (pinged-p nil)
  ;; The message being received: the internal real time its first frame
  ;; began (NIL between messages), and its octets kept so far
  ;; (websocket-message.lisp), NIL while none are.
  (message-started nil :type (or null fixnum))
  (message nil)
  ;; The payloads of the pings heard this turn, not answered yet, newest
  ;; first, and the octets of their pongs: the turn's pongs leave as one
  ;; vector, so that a flood of pings costs one send, and a client that
  ;; reads none of them fills its queue as fast as it pings.
  (ping-payloads '())
  (pong-octets 0 :type fixnum))

(defmethod print-object ((websocket websocket) stream)
  (print-unreadable-object (websocket stream :type t :identity t)
    (format stream "~S" (websocket-state websocket))))

(defun make-websocket (set connection resource client acceptor reader &optional deflate-window-bits)
  "Make CONNECTION, in SET, a WEBSOCKET for CLIENT of RESOURCE, with
ACCEPTOR's limits and the turns' frame READER, its messages compressed
with DEFLATE-WINDOW-BITS when permessage-deflate was agreed, counted open;
returns it."
  (atomic-increment (readiness-set-websocket-count set))
  (setf (connection-websocket connection)
              (%make-websocket :connection connection :set set :acceptor acceptor :resource resource :client client
                         :reader reader :deflate-window-bits deflate-window-bits
                         :max-queue-bytes (acceptor-max-websocket-queue-bytes acceptor)
                         :ping-interval (seconds->internal-units (acceptor-websocket-ping-interval acceptor))
                         :timeout (seconds->internal-units (acceptor-websocket-timeout acceptor))
                         :message-timeout (seconds->internal-units (acceptor-websocket-message-timeout acceptor))
                         :last-heard (get-internal-real-time))))

(defun websocket-message-length (websocket)
  "The octets of WEBSOCKET's message kept so far."
  (let ((message (websocket-message websocket)))
    (if message (arriving-message-length message) 0)))

(defun websocket-counters (websocket)
  (readiness-set-counters (websocket-set websocket)))

;;; Sending.

(defun note-websocket-ping (websocket payload)
  "WEBSOCKET's client pinged with PAYLOAD: its pong goes when the turn ends."
  (push payload (websocket-ping-payloads websocket))
  (incf (websocket-pong-octets websocket) (+ (frame-head-length (length payload)) (length payload))))

(defun queue-websocket-pongs (websocket)
  "Queue the pongs answering the pings of the turn, in order, as one
vector taken from the memory budget.  A client whose pongs would pass
MAX-QUEUE-BYTES is to close with 1008, as any client that does not read
what it is sent; with 1013 when the budget has no room for them."
  (let ((payloads (shiftf (websocket-ping-payloads websocket) '()))
        (octets (shiftf (websocket-pong-octets websocket) 0)))
    (cond ((or (null payloads) (not (eq (websocket-state websocket) :open))))
          ((> (+ (websocket-unsent-octets websocket) octets) (websocket-max-queue-bytes websocket))
           (refuse-outbox-send websocket 1008))
          (t (let ((frame (make-counted-octets (readiness-set-memory-budget (websocket-set websocket)) octets))
                   (position 0))
               (if (null frame)
                   (refuse-outbox-send websocket 1013)
                   (let ((pongs (counted-octets-octets frame)))
                     (dolist (payload (nreverse payloads))
                       (setf position (write-frame-head pongs +pong-opcode+ (length payload) position))
                       (replace pongs payload :start1 position)
                       (incf position (length payload)))
                     (queue-counted-octets websocket frame))))))))

(defun drop-websocket-message (websocket)
  "Forget WEBSOCKET's message so far, if any, giving its pieces back to the
memory budget."
  (let ((message (shiftf (websocket-message websocket) nil)))
    (when message
      (release-message message (readiness-set-memory-budget (websocket-set websocket))))))

(defun queue-websocket-frame (websocket frame)
  "Queue FRAME, the fresh octets of a control frame (a ping, a close), on
WEBSOCKET, held by the caller, whatever its state and limit."
  (queue-counted-octets websocket (uncounted-octets frame)))

(defun send-websocket-queue (websocket)
  "Send what waits for WEBSOCKET (SEND-OUTBOX-QUEUE), counting the octets
sent: :SENT, :WOULD-BLOCK or :FAILED."
  (multiple-value-bind (status sent) (send-outbox-queue websocket)
    (atomic-add (connection-counters-websocket-octets-out (websocket-counters websocket)) sent)
    status))

(defun send-close-frame (websocket code reason)
  "Queue WEBSOCKET's close frame with CODE and REASON, held by the caller,
and mark it closing."
  (setf (websocket-close-code websocket) code
        (websocket-close-reason websocket) reason
        (websocket-close-sent-p websocket) t
        (websocket-state websocket) :closing)
  (queue-websocket-frame websocket (frame-octets +close-opcode+ (close-payload code reason))))

;;; Waiting in the readiness set.

(defun websocket-deadline (websocket)
  "When WEBSOCKET, about to park, is next looked at without its client:
for a client that takes none of what waits to be sent, the write timeout
from when it last took some; closing, the end of the wait for the
client's close frame; else the time to ping it, or to give up on it once
pinged."
  (let ((now (get-internal-real-time)))
    (cond ((websocket-queue websocket) (outbox-write-deadline websocket now))
          ((eq (websocket-state websocket) :closing)
           (+ now (seconds->internal-units +websocket-closing-seconds+)))
          (t (min (+ (websocket-last-heard websocket)
                     (if (websocket-pinged-p websocket)
                         (websocket-timeout websocket)
                         (min (websocket-ping-interval websocket) (websocket-timeout websocket))))
                  (let ((started (websocket-message-started websocket)))
                    (if started
                        (+ started (websocket-message-timeout websocket))
                        most-positive-fixnum)))))))

(defun park-websocket (websocket)
  "Send what WEBSOCKET has to send, then park its connection, held by the
caller, until its client sends, its socket has room for the rest, or its
deadline (WEBSOCKET-DEADLINE).  Returns T when parked (and perhaps another
thread's already); :CLOSE when the caller is to close it: it was asked to
close or a send to it was refused, its client has gone, or the descriptor
could not be armed."
  (let* ((connection (websocket-connection websocket))
         (set (websocket-set websocket)))
    (loop
      (let ((requested (shiftf (websocket-close-requested websocket) nil)))
        (when (and requested (eq (websocket-state websocket) :open))
          (send-close-frame websocket (first requested) (second requested))))
      (let ((code (websocket-refusal-code websocket)))
        (when code
          (setf (websocket-close-code websocket) code
                (websocket-close-reason websocket) (if (eql code 1008) "Too much unsent" "Out of memory"))
          (return :close)))
      (queue-websocket-pongs websocket)
      (when (eq (send-websocket-queue websocket) :failed)
        (setf (websocket-close-code websocket) 1006)
        (return :close))
      (let ((deadline (websocket-deadline websocket)))
        (setf (connection-awaiting connection) (if (websocket-queue websocket) :output :input)
              (connection-timeout-status connection) nil)
        (unless (park-connection set connection deadline)
          (return :close)))
      ;; See "Sending from any thread" in outbox.lisp.
      (memory-barrier)
      (unless (and (or (websocket-inbox websocket) (websocket-close-requested websocket)
                       (websocket-refusal-code websocket))
                   (take-parked-connection connection))
        (return t)))))

(defun websocket-deadline-reached (websocket)
  "WEBSOCKET's connection, held by the caller, was parked until a deadline
that has passed.  Ping a client silent for the ping interval, and park it
again; :CLOSE when the caller is to close it: silent since the timeout
(1001), taking none of what is sent for the write timeout (1008), or
closing and the client's close frame never came."
  (let ((connection (websocket-connection websocket))
        (now (get-internal-real-time)))
    (flet ((close-with (code reason)
             (setf (websocket-close-code websocket) code
                   (websocket-close-reason websocket) reason)
             :close))
      (cond ((websocket-queue websocket)
             (if (client-took-octets-p connection)
                 (park-websocket websocket)
                 (close-with 1008 "Not reading")))
            ((eq (websocket-state websocket) :closing) :close)
            ((>= now (+ (websocket-last-heard websocket) (websocket-timeout websocket)))
             (close-with 1001 "No answer"))
            ((and (websocket-message-started websocket)
                  (>= now (+ (websocket-message-started websocket) (websocket-message-timeout websocket))))
             (close-with 1008 "Message too slow"))
            ((< now (+ (websocket-last-heard websocket) (websocket-ping-interval websocket)))
             ;; Woken for the message's deadline or the timeout, not to ping.
             (park-websocket websocket))
            (t (setf (websocket-pinged-p websocket) t)
               (queue-websocket-frame websocket (frame-octets +ping-opcode+ (make-array 0 :element-type '(unsigned-byte 8))))
               (park-websocket websocket))))))

;;; The end.

(defun end-websocket (websocket)
  "WEBSOCKET's connection, held by the caller, is being closed: send what
the socket takes of what is queued and the close frame, if not sent yet
and the client is there to read it; count the close; take the client from
its resource and tell the resource (WS:CLIENT-DISCONNECTED), an error of
which is logged."
  (unless (eq (websocket-state websocket) :closed)
    (let ((code (or (websocket-close-code websocket) 1001))
          (set (websocket-set websocket)))
      (unless (or (websocket-close-sent-p websocket) (eql code 1006))
        (send-close-frame websocket code (websocket-close-reason websocket)))
      (unless (eql code 1006)
        (send-websocket-queue websocket)
        (linger-before-close (websocket-connection websocket)))
      (setf (websocket-state websocket) :closed)
      (drop-outbox-queue websocket)
      (drop-websocket-message websocket)
      (count-websocket-close (readiness-set-counters set) code)
      (atomic-decrement (readiness-set-websocket-count set))
      (let ((resource (websocket-resource websocket))
            (client (websocket-client websocket)))
        (remove-resource-client resource client)
        (handler-case (ws:client-disconnected resource client)
          (error (condition)
            (log-safely (websocket-acceptor websocket) :error "Error in CLIENT-DISCONNECTED of ~A: ~A" resource condition)))))))
