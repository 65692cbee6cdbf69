;;;; A connection that has become a websocket: what the engine keeps of it
;;;; between frames, how what is sent to it leaves, and how it waits in the
;;;; readiness set -- for the client's next octets, for room in its socket,
;;;; for the time to ping it.  Its frames are read by
;;;; engine/serving/websocket-turn.lisp.
;;;;
;;;; Sending from any thread.  Only a connection's holder writes to its
;;;; socket and touches its QUEUE (connection.lisp, Ownership).  A thread
;;;; sending a frame adds it to the INBOX, lock-free, then tries to take
;;;; the connection as a parked one (compare-and-swap :PARKED -> :ACTIVE):
;;;; when it wins, it is the holder and sends; when it loses, the holder
;;;; sends the frame before it parks.  A holder parks, then looks at the
;;;; INBOX again and takes the connection back if a frame came meanwhile:
;;;; of the sender's push and the holder's park, whichever comes second sees
;;;; the other, so that no frame waits in an INBOX of a parked connection.
;;;; Nothing here waits: what the socket does not take stays in the QUEUE
;;;; and the connection parks until the socket has room.
;;;;
;;;; These functions never close the connection: they say when the caller
;;;; is to (CLOSE-CONNECTION, closing.lisp, ends the websocket).

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +websocket-closing-seconds+ 5
  "Seconds a websocket that sent its close frame waits for the client's.")

(defstruct (websocket (:constructor %make-websocket))
  "What the engine keeps of a connection that is a websocket."
  (connection nil :read-only t)
  ;; The readiness set CONNECTION is in.
  (set nil :read-only t)
  ;; The acceptor it was opened on, for its limits and its log.
  (acceptor nil :read-only t)
  (resource nil :read-only t)
  (client nil :read-only t)
  ;; :OPEN; :CLOSING once its close frame is sent and the client's is
  ;; awaited; :CLOSED.  Senders read it; the holder writes it.
  (state :open)
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
  ;; Limits and times, from the acceptor: octets, internal time units.
  (max-queue-bytes 0 :type fixnum :read-only t)
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
  (pong-octets 0 :type fixnum)
  ;; Frames sent by threads that did not hold the connection, as
  ;; COUNTED-OCTETS, newest first: any thread pushes, the holder takes.
  (inbox '())
  ;; The PIECEs the socket has not taken, in order, and the last cons of
  ;; the list, so that a piece is added at its end in constant time: the
  ;; holder's.
  (queue '())
  (queue-tail '())
  ;; Octets in INBOX and QUEUE: senders add, the holder subtracts.
  (unsent-octets 0 :type word)
  ;; NIL, or the code the holder closes the client with because a send
  ;; was refused: 1008 when it found no room under MAX-QUEUE-BYTES, 1013
  ;; when the memory budget had none.
  (refusal-code nil))

(defmethod print-object ((websocket websocket) stream)
  (print-unreadable-object (websocket stream :type t :identity t)
    (format stream "~S" (websocket-state websocket))))

(defun make-websocket (set connection resource client acceptor reader)
  "Make CONNECTION, in SET, a WEBSOCKET for CLIENT of RESOURCE, with
ACCEPTOR's limits and the turns' frame READER, counted open; returns it."
  (atomic-increment (readiness-set-websocket-count set))
  (setf (connection-websocket connection)
              (%make-websocket :connection connection :set set :acceptor acceptor :resource resource :client client
                         :reader reader
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

(defun refuse-websocket-send (websocket code)
  "A send to WEBSOCKET was refused: its holder closes it with CODE."
  (compare-and-swap (websocket-refusal-code websocket) nil code)
  nil)

(defun offer-websocket-frame (websocket frame)
  "Add FRAME, the COUNTED-OCTETS of a frame the caller holds, to what
WEBSOCKET's holder sends, from any thread; the queue holds it from now on.
False, and nothing added, when the websocket is closing or closed, or when
FRAME does not fit under its MAX-QUEUE-BYTES (then it is to close with
1008)."
  (let ((length (length (counted-octets-octets frame))))
    (cond ((not (eq (websocket-state websocket) :open)) nil)
          ((> (+ (websocket-unsent-octets websocket) length) (websocket-max-queue-bytes websocket))
           (refuse-websocket-send websocket 1008))
          ((not (hold-counted-octets frame)) nil)
          (t (atomic-add (websocket-unsent-octets websocket) length)
             (loop for old = (websocket-inbox websocket)
                   until (compare-and-swap (websocket-inbox websocket) old (cons frame old)))
             (when (eq (websocket-state websocket) :closed)
               ;; Ended meanwhile, its queue dropped (END-WEBSOCKET sets
               ;; :CLOSED first): no holder will take this frame.
               (mapc #'let-go-of-counted-octets (take-inbox-frames websocket)))
             t))))

(defun enqueue-websocket-piece (websocket piece)
  "Add PIECE at the end of WEBSOCKET's QUEUE, held by the caller."
  (let ((cell (list piece)))
    (if (websocket-queue websocket)
        (setf (cdr (websocket-queue-tail websocket)) cell)
        (setf (websocket-queue websocket) cell))
    (setf (websocket-queue-tail websocket) cell)))

(defun take-inbox-frames (websocket)
  "Empty WEBSOCKET's INBOX; the frames it held, newest first.  Each frame
pushed is so taken by exactly one thread."
  (loop for old = (websocket-inbox websocket)
        until (compare-and-swap (websocket-inbox websocket) old '())
        finally (return old)))

(defun take-websocket-inbox (websocket)
  "Move the frames in WEBSOCKET's INBOX to the end of its QUEUE, in the
order they were sent."
  (dolist (frame (nreverse (take-inbox-frames websocket)))
    (enqueue-websocket-piece websocket (make-counted-piece frame))))

(defun queue-counted-frame (websocket frame)
  "Queue FRAME, COUNTED-OCTETS whose hold passes to the queue, on
WEBSOCKET, held by the caller, whatever its state and limit."
  (atomic-add (websocket-unsent-octets websocket) (length (counted-octets-octets frame)))
  (enqueue-websocket-piece websocket (make-counted-piece frame)))

(defun queue-websocket-frame (websocket frame)
  "Queue FRAME, the fresh octets of a control frame (a ping, a close), on
WEBSOCKET, held by the caller, whatever its state and limit."
  (queue-counted-frame websocket (uncounted-octets frame)))

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
           (refuse-websocket-send websocket 1008))
          (t (let ((frame (make-counted-octets (readiness-set-memory-budget (websocket-set websocket)) octets))
                   (position 0))
               (if (null frame)
                   (refuse-websocket-send websocket 1013)
                   (let ((pongs (counted-octets-octets frame)))
                     (dolist (payload (nreverse payloads))
                       (setf position (write-frame-head pongs +pong-opcode+ (length payload) position))
                       (replace pongs payload :start1 position)
                       (incf position (length payload)))
                     (queue-counted-frame websocket frame))))))))

(defun drop-websocket-queue (websocket)
  "Let go of every frame waiting for WEBSOCKET, held by the caller."
  (mapc #'let-go-of-counted-octets (take-inbox-frames websocket))
  (dolist (piece (shiftf (websocket-queue websocket) '()))
    (let-go-of-counted-octets (piece-counted piece)))
  (setf (websocket-queue-tail websocket) '()))

(defun drop-websocket-message (websocket)
  "Forget WEBSOCKET's message so far, if any, giving its pieces back to the
memory budget."
  (let ((message (shiftf (websocket-message websocket) nil)))
    (when message
      (release-message message (readiness-set-memory-budget (websocket-set websocket))))))

(defun send-websocket-queue (websocket)
  "Send what WEBSOCKET's QUEUE holds, after the frames of its INBOX, as far
as the socket takes it now.  The caller holds the connection.  :SENT,
:WOULD-BLOCK, or :FAILED when the client has gone."
  (take-websocket-inbox websocket)
  (let* ((connection (websocket-connection websocket))
         (fd (connection-fd connection))
         (tls-stream (and (not (plain-connection-p connection)) (connection-stream connection)))
         (counters (websocket-counters websocket)))
    (loop for piece = (first (websocket-queue websocket))
          while piece
          do (let ((count (if tls-stream
                              (send-tls-octets tls-stream (piece-octets piece) (piece-start piece) (piece-end piece))
                              (send-octets fd (piece-octets piece) (piece-start piece) (piece-end piece)
                                           :more (rest (websocket-queue websocket))))))
               (case count
                 (:would-block (return :would-block))
                 ((:error 0) (return :failed))
                 (t (incf (piece-start piece) count)
                    (atomic-subtract (websocket-unsent-octets websocket) count)
                    (atomic-add (connection-counters-websocket-octets-out counters) count)
                    (when (= (piece-start piece) (piece-end piece))
                      (pop (websocket-queue websocket))
                      (let-go-of-counted-octets (piece-counted piece))))))
          finally (return :sent))))

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
  (let ((set (websocket-set websocket))
        (connection (websocket-connection websocket))
        (now (get-internal-real-time)))
    (cond ((websocket-queue websocket)
           ;; Sends to a client that reads nothing do not put its end off.
           (if (and (eq (connection-awaiting connection) :output)
                    (< now (connection-deadline connection))
                    (not (client-took-octets-p connection)))
               (connection-deadline connection)
               (progn (note-unacknowledged-octets connection)
                      (+ now (readiness-set-write-timeout set)))))
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
      ;; See "Sending from any thread" above.
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
      (drop-websocket-queue websocket)
      (drop-websocket-message websocket)
      (count-websocket-close (readiness-set-counters set) code)
      (atomic-decrement (readiness-set-websocket-count set))
      (let ((resource (websocket-resource websocket))
            (client (websocket-client websocket)))
        (remove-resource-client resource client)
        (handler-case (ws:client-disconnected resource client)
          (error (condition)
            (log-safely (websocket-acceptor websocket) :error "Error in CLIENT-DISCONNECTED of ~A: ~A" resource condition)))))))
