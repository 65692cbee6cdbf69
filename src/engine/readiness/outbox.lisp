;;;; What any thread sends to a held connection -- a websocket's frames, an
;;;; event stream's events -- and how it leaves.  Nothing here waits: what
;;;; the socket does not take stays in the QUEUE, and the connection parks
;;;; until the socket has room (websocket-connection.lisp,
;;;; event-stream.lisp).
;;;;
;;;; Sending from any thread.  Only a connection's holder writes to its
;;;; socket and touches its QUEUE (connection.lisp, Ownership).  A thread
;;;; sending adds its octets to the INBOX, lock-free, then tries to take
;;;; the connection as a parked one (compare-and-swap :PARKED -> :ACTIVE):
;;;; when it wins, it is the holder and sends; when it loses, the holder
;;;; sends them before it parks.  A holder parks, then looks at the INBOX
;;;; again and takes the connection back if octets came meanwhile: of the
;;;; sender's push and the holder's park, whichever comes second sees the
;;;; other, so that nothing waits in the INBOX of a parked connection.

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (outbox (:constructor nil))
  "What waits to be sent to a held connection, whoever sent it."
  (connection nil :read-only t)
  ;; The readiness set CONNECTION is in.
  (set nil :read-only t)
  ;; :OPEN; a websocket's :CLOSING once its close frame is sent; :CLOSED.
  ;; Senders read it; the holder writes it.
  (state :open)
  ;; The most octets that may wait in INBOX and QUEUE together.
  (max-queue-bytes 0 :type fixnum :read-only t)
  ;; COUNTED-OCTETS sent by threads that did not hold the connection,
  ;; newest first: any thread pushes, the holder takes.
  (inbox '())
  ;; The PIECEs the socket has not taken, in order, and the last cons of
  ;; the list, so that a piece is added at its end in constant time: the
  ;; holder's.
  (queue '())
  (queue-tail '())
  ;; Octets in INBOX and QUEUE: senders add, the holder subtracts.
  (unsent-octets 0 :type word)
  ;; NIL, or the code the holder closes the connection with because a
  ;; send was refused: 1008 when it found no room under MAX-QUEUE-BYTES,
  ;; 1013 when the memory budget had none.
  (refusal-code nil))

(defun refuse-outbox-send (outbox code)
  "A send to OUTBOX was refused: its holder closes it with CODE.  NIL."
  (compare-and-swap (outbox-refusal-code outbox) nil code)
  nil)

(defun take-inbox-octets (outbox)
  "Empty OUTBOX's INBOX; the octets it held, newest first.  Each pushed is
so taken by exactly one thread."
  (loop for old = (outbox-inbox outbox)
        until (compare-and-swap (outbox-inbox outbox) old '())
        finally (return old)))

(defun take-outbox-room (outbox length)
  "Count LENGTH octets more as waiting in OUTBOX, from any thread: true
when they fit under its MAX-QUEUE-BYTES, or when nothing waits -- one
message is taken whatever its length, so that what a sender may send
reaches a client that reads; false, nothing counted, otherwise."
  (loop for unsent = (outbox-unsent-octets outbox)
        do (cond ((and (plusp unsent) (> (+ unsent length) (outbox-max-queue-bytes outbox))) (return nil))
                 ((compare-and-swap (outbox-unsent-octets outbox) unsent (+ unsent length))
                  (return t)))))

(defun offer-outbox-octets (outbox counted)
  "Add COUNTED, COUNTED-OCTETS the caller holds, to what OUTBOX's holder
sends, from any thread; the outbox holds them from now on.  False, and
nothing added, when it is not open, or when COUNTED finds no room
(TAKE-OUTBOX-ROOM: then it is to close with 1008)."
  (let ((length (length (counted-octets-octets counted))))
    (cond ((not (eq (outbox-state outbox) :open)) nil)
          ((not (hold-counted-octets counted)) nil)
          ((not (take-outbox-room outbox length))
           (let-go-of-counted-octets counted)
           (refuse-outbox-send outbox 1008))
          (t (loop for old = (outbox-inbox outbox)
                   until (compare-and-swap (outbox-inbox outbox) old (cons counted old)))
             (when (eq (outbox-state outbox) :closed)
               ;; Ended meanwhile, its queue dropped (the end sets :CLOSED
               ;; first): no holder will take these octets.
               (mapc #'let-go-of-counted-octets (take-inbox-octets outbox)))
             t))))

(defun enqueue-outbox-piece (outbox piece)
  "Add PIECE at the end of OUTBOX's QUEUE, held by the caller."
  (let ((cell (list piece)))
    (if (outbox-queue outbox)
        (setf (cdr (outbox-queue-tail outbox)) cell)
        (setf (outbox-queue outbox) cell))
    (setf (outbox-queue-tail outbox) cell)))

(defun queue-counted-octets (outbox counted)
  "Queue COUNTED, COUNTED-OCTETS whose hold passes to the queue, on
OUTBOX, held by the caller, whatever its state and limit."
  (atomic-add (outbox-unsent-octets outbox) (length (counted-octets-octets counted)))
  (enqueue-outbox-piece outbox (make-counted-piece counted)))

(defun drop-outbox-queue (outbox)
  "Let go of everything waiting in OUTBOX, held by the caller."
  (mapc #'let-go-of-counted-octets (take-inbox-octets outbox))
  (dolist (piece (shiftf (outbox-queue outbox) '()))
    (let-go-of-counted-octets (piece-counted piece)))
  (setf (outbox-queue-tail outbox) '()))

(defun send-outbox-queue (outbox)
  "Send what OUTBOX's QUEUE holds, after what its INBOX holds, as far as
the socket takes it now.  The caller holds the connection.  :SENT,
:WOULD-BLOCK, or :FAILED when the client has gone; second value, the
octets sent."
  (dolist (counted (nreverse (take-inbox-octets outbox)))
    (enqueue-outbox-piece outbox (make-counted-piece counted)))
  (let* ((connection (outbox-connection outbox))
         (fd (connection-fd connection))
         (tls-stream (and (not (plain-connection-p connection)) (connection-stream connection)))
         (sent 0))
    (loop for piece = (first (outbox-queue outbox))
          while piece
          do (let ((count (if tls-stream
                              (send-tls-octets tls-stream (piece-octets piece) (piece-start piece) (piece-end piece))
                              (send-octets fd (piece-octets piece) (piece-start piece) (piece-end piece)
                                           :more (rest (outbox-queue outbox))))))
               (case count
                 (:would-block (return (values :would-block sent)))
                 ((:error 0) (return (values :failed sent)))
                 (t (incf (piece-start piece) count)
                    (incf sent count)
                    (atomic-subtract (outbox-unsent-octets outbox) count)
                    (when (= (piece-start piece) (piece-end piece))
                      (pop (outbox-queue outbox))
                      (let-go-of-counted-octets (piece-counted piece))))))
          finally (return (values :sent sent)))))

(defun outbox-write-deadline (outbox now)
  "When OUTBOX's connection, about to park with octets waiting, is to be
looked at without its client: the write timeout from when the client last
took some of them.  Sends to a client that reads nothing do not put its
end off; a deadline of another wait (an HTTP/2 connection's none while
its handlers run) is no write deadline to keep."
  (let* ((connection (outbox-connection outbox))
         (write-deadline (+ now (readiness-set-write-timeout (outbox-set outbox)))))
    (if (and (eq (connection-awaiting connection) :output)
             (< now (connection-deadline connection) write-deadline)
             (not (client-took-octets-p connection)))
        (connection-deadline connection)
        (progn (note-unacknowledged-octets connection)
               write-deadline))))
