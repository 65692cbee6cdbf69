;;;; The replies of a worker's batch of ready connections, sent together.
;;;; A worker woken with several connections ready serves them one after
;;;; the other (worker-tasks.lisp).  Each reply sent at once on loopback
;;;; wakes a client that has drained the last one and sleeps: a proxy or
;;;; load generator on the same host, an interprocessor interrupt each, the
;;;; largest part of ours' kernel time a request above the engine floor's
;;;; (bench/profiles/2026-11-29-reply-objects-and-closing.txt).  So a
;;;; worker keeps the whole replies of its batch in its REPLY-BATCH, copied
;;;; there, and sends them together before it waits on the set again
;;;; (SEND-REPLY-BATCH): the client, woken by the first, finds the rest
;;;; (bench/profiles/2026-12-01-reply-batch.txt).  A connection's turn ends
;;;; once its reply has gone: until then it is neither parked nor held in
;;;; the pool, only named by the batch, and only the batch's sender touches
;;;; it (connection.lisp, Ownership).
;;;;
;;;; What may wait so: a kept-alive or closing connection's last reply of
;;;; its turn, a handler's or a deferred reply's (a reply followed by
;;;; another request of the same connection goes first, SEND-BATCHED-REPLY:
;;;; the next handler may write to the stream itself), of a worker whose
;;;; last request was quick (under +LONG-REQUEST-SECONDS+).  A handler that blocks after quick ones would
;;;; still hold the replies before it: the first reply of a batch arms a
;;;; call within +TASK-NUDGE-MILLISECONDS+ (CALL-SOON), in whichever worker
;;;; its timer wakes, which sends the batch in its owner's place when the
;;;; owner has not sent it by then.  A reply so waits at most about two
;;;; nudges, as the tasks queued behind a slow handler do.
;;;;
;;;; Who writes what.  The owner alone adds a reply (its octets and entry,
;;;; then COUNT after a write barrier) and sets an entry's THEN as its
;;;; connection's turn ends, without a lock: two locks a request were 3% of
;;;; its user time.  The replies whose turns have ended are sent under LOCK,
;;;; by the owner or by the call in its place; only the owner empties the
;;;; batch, under LOCK, since it may be adding to it meanwhile.  An entry
;;;; whose THEN is NIL is the owner's current turn, which nobody else sends;
;;;; once THEN is set the owner touches neither the entry nor its
;;;; connection.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +reply-batch-octets+ 32768
  "The octets of replies a worker's batch holds: a reply that does not fit
sends those before it, one larger than this is sent at once.")

(defconstant +reply-batch-replies+ 16
  "The replies a worker's batch holds, as many as one wait reports
(+READY-TOKENS-PER-WAIT+); one more sends those before it.  A timer
completing a thousand deferred replies so sends them 16 at a time, its
clients answering the first while the worker makes the next.")

(defstruct (reply-batch (:constructor %make-reply-batch (set)))
  "The whole replies a worker holds until its batch of ready connections
has been served."
  (set nil :type readiness-set :read-only t)
  (lock (bt:make-lock "reply-batch") :read-only t)
  ;; The replies' octets, each one's below the next one's; END octets used.
  (octets (make-array +reply-batch-octets+ :element-type '(unsigned-byte 8)) :type octets :read-only t)
  (end 0 :type fixnum)
  ;; The replies, COUNT of them: each one's connection (NIL once sent), its
  ;; octets' start and end in OCTETS, and what follows once it has gone --
  ;; :PARK or :CLOSE, or NIL while the connection's turn goes on.
  (count 0 :type fixnum)
  (connections (make-array +reply-batch-replies+ :initial-element nil) :type simple-vector :read-only t)
  (starts (make-array +reply-batch-replies+ :element-type 'fixnum :initial-element 0)
   :type (simple-array fixnum (*)) :read-only t)
  (ends (make-array +reply-batch-replies+ :element-type 'fixnum :initial-element 0)
   :type (simple-array fixnum (*)) :read-only t)
  (thens (make-array +reply-batch-replies+ :initial-element nil) :type simple-vector :read-only t)
  ;; Counts the batches sent: the one filling now is not the one the call
  ;; due was armed for when they differ.
  (generation 0 :type fixnum)
  ;; The GENERATION the call that sends in the owner's place was armed
  ;; for, or NIL when none is due; and that call, made once.
  (armed-generation nil)
  (send-in-place nil))

(defmethod print-object ((batch reply-batch) stream)
  ;; Its octets are other clients' replies.
  (print-unreadable-object (batch stream :type t :identity t)
    (format stream "~D replies" (reply-batch-count batch))))

(defun make-reply-batch (set)
  "A worker's REPLY-BATCH for the connections of SET."
  (let ((batch (%make-reply-batch set)))
    (setf (reply-batch-send-in-place batch) (lambda () (send-reply-batch-in-place batch)))
    batch))

(defun arm-send-in-place (batch)
  "Have BATCH's current replies sent by another worker soon if its owner
has not sent them by then, unless a call for that is due already."
  (when (compare-and-swap (reply-batch-armed-generation batch) nil (reply-batch-generation batch))
    (call-soon (reply-batch-set batch) (reply-batch-send-in-place batch))))

(defun batch-room-p (batch octets)
  "True when BATCH has room for one more reply of OCTETS octets."
  (and (< (reply-batch-count batch) +reply-batch-replies+)
       (<= (+ (reply-batch-end batch) octets) +reply-batch-octets+)))

(defun batch-reply (batch connection octets end)
  "Keep the reply whose octets are OCTETS below END, a buffer the caller
reuses, for CONNECTION, held by the caller, in BATCH, the caller's, to be
sent with the others of the batch, once those are sent when it has no
room left.  False, nothing kept, when the reply alone is larger."
  (declare (type octets octets) (type fixnum end))
  (unless (batch-room-p batch end)
    (send-reply-batch batch))
  (when (batch-room-p batch end)
    (let ((index (reply-batch-count batch))
          (start (reply-batch-end batch)))
      (replace (reply-batch-octets batch) octets :start1 start :end2 end)
      (setf (svref (reply-batch-connections batch) index) connection
            (aref (reply-batch-starts batch) index) start
            (aref (reply-batch-ends batch) index) (+ start end)
            (svref (reply-batch-thens batch) index) nil
            (reply-batch-end batch) (+ start end)
            (connection-batch connection) batch)
      (write-barrier)
      (setf (reply-batch-count batch) (1+ index))
      (arm-send-in-place batch)
      t)))

(defun batched-reply-index (batch connection)
  "The index of CONNECTION's reply in BATCH."
  (position connection (reply-batch-connections batch) :end (reply-batch-count batch) :from-end t))

(defun send-batched-octets (batch index)
  "Send the reply at INDEX of BATCH without waiting, and forget it there:
:SENT; :REST when the socket took part of it (the rest, copied, is its
connection's OUTGOING); :FAILED when the client has gone."
  (let* ((connection (svref (reply-batch-connections batch) index))
         (octets (reply-batch-octets batch))
         (start (aref (reply-batch-starts batch) index))
         (end (aref (reply-batch-ends batch) index))
         (sent (send-octets (connection-fd connection) octets start end)))
    (setf (svref (reply-batch-connections batch) index) nil
          (svref (reply-batch-thens batch) index) nil
          (connection-batch connection) nil)
    (cond ((eql sent (- end start)) :sent)
          ((eq sent :error) :failed)
          (t ;; Octets only: KEEP-OUTGOING needs no descriptor, and keeps them.
             (keep-outgoing (reply-batch-set batch) connection
                            (list (make-octets-piece octets (+ start (if (integerp sent) sent 0)) end))
                            nil octets)
             :rest))))

(defun send-batched-reply (connection)
  "Send now CONNECTION's reply that waits in its batch, if one does: before
the connection, held by the caller, goes on.  What was not taken is its
OUTGOING.  False when its client has gone."
  (let ((batch (connection-batch connection)))
    (or (null batch)
        (not (eq (send-batched-octets batch (batched-reply-index batch connection)) :failed)))))

(defun end-turn-after-batched-reply (set connection then sent)
  "End the turn of CONNECTION, which THEN (:PARK, :CLOSE) follows, now that
its batched reply was SENT (SEND-BATCHED-OCTETS)."
  (ecase sent
    (:sent (if (eq then :park)
               (park-or-end set connection nil 0)
               (close-connection set connection)))
    (:rest (setf (outgoing-then (connection-outgoing connection)) (if (eq then :park) :keep-alive :close))
     (park-until-writable set connection nil 0))
    (:failed (close-connection set connection))))

(defun send-ended-turns (batch)
  "Send every reply of BATCH whose connection's turn has ended, and end
that turn.  LOCK held."
  (let ((set (reply-batch-set batch))
        (count (reply-batch-count batch)))
    (read-barrier)
    (dotimes (index count)
      (let ((connection (svref (reply-batch-connections batch) index))
            (then (svref (reply-batch-thens batch) index)))
        (read-barrier)
        (when (and connection then)
          (end-turn-after-batched-reply set connection then (send-batched-octets batch index)))))))

(defun send-reply-batch (batch)
  "Send the replies BATCH holds, their turns ended, and empty it: by its
owner before it waits on the set again."
  (when (plusp (reply-batch-count batch))
    (bt:with-lock-held ((reply-batch-lock batch))
      (send-ended-turns batch)
      (when (notany #'identity (reply-batch-connections batch))
        (setf (reply-batch-count batch) 0
              (reply-batch-end batch) 0)
        (incf (reply-batch-generation batch))))))

(defun end-turn-on-batched-reply (connection then)
  "CONNECTION's turn ends with THEN (:PARK, :CLOSE) once its reply, waiting
in its batch, has gone: it is left to the batch's sender."
  (let ((batch (connection-batch connection)))
    (let ((index (batched-reply-index batch connection)))
      ;; What the turn did to the connection is seen by whoever sends.
      (write-barrier)
      (setf (svref (reply-batch-thens batch) index) then))))

(defun send-reply-batch-in-place (batch)
  "The call armed by BATCH's first reply: send the replies of the batch it
was armed for in its owner's place if they still wait, its owner held up;
armed again while a reply waits (a new one arms it itself)."
  (bt:with-lock-held ((reply-batch-lock batch))
    (let ((armed (shiftf (reply-batch-armed-generation batch) nil)))
      ;; A THEN is set while its reply waits (SEND-BATCHED-OCTETS clears it).
      (when (and (eql armed (reply-batch-generation batch))
                 (some #'identity (reply-batch-thens batch)))
        (atomic-increment (connection-counters-batches-sent-in-place
                           (readiness-set-counters (reply-batch-set batch))))
        (send-ended-turns batch))
      (when (some #'identity (reply-batch-connections batch))
        (arm-send-in-place batch)))))
