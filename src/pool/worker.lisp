;;;; A worker: one pooled thread's record, and every change of pool state a
;;;; worker makes, each one small function (see the locking discipline in
;;;; pool/taskmaster.lisp).

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (worker (:constructor make-worker (taskmaster)))
  "One pooled thread.  STATE is :STARTING (made, not yet waiting), :WAITING
(in the engine's wait for something to serve), :RESTING (idle, off the
engine, while enough others wait there), :SERVING (holding a
connection outside any request: accepting it, its TLS handshake, reading
heads, parking it), :IN-REQUEST (from a complete head to the reply sent), or
:EXITING (counted out of the pool)."
  (taskmaster nil :read-only t)
  (thread nil)
  (state :starting :type keyword)
  ;; The engine's connection this worker holds, or NIL; see CONNECTION-LOCK.
  (connection nil)
  ;; Taken to let go of CONNECTION, and by STOP to shut it down.
  (connection-lock (bt:make-lock "worker-connection") :read-only t)
  (requests-served 0 :type fixnum)
  ;; When WORKER's current or last request began (MONOTONIC-MICROSECONDS).
  (request-started 0 :type fixnum)
  ;; True when WORKER's last request took +LONG-REQUEST-SECONDS+ or more.
  (last-request-long-p nil)
  ;; True when WORKER's last turn began with a new connection (JOIN-WAITING).
  (last-turn-new-p nil))

(defconstant +long-request-seconds+ 1/1000
  "A request that takes this long waited on something -- a timer, a client,
a database -- or on busy processors; the worker that served it goes back to
wait on the engine past MAX-WAITING-THREAD-COUNT (WAITING-LIMIT), since
handlers that wait need workers in circulation.")

(declaim (inline long-request-p))
(defun long-request-p (microseconds)
  "True when a request that has run MICROSECONDS is long: it has run
+LONG-REQUEST-SECONDS+ or more."
  (>= microseconds (load-time-value (round (* +long-request-seconds+ 1000000)))))

(defmethod print-object ((worker worker) stream)
  (print-unreadable-object (worker stream :type t :identity t)
    (format stream "~S, ~D requests" (worker-state worker) (worker-requests-served worker))))

(defvar *worker* nil
  "The WORKER record of the current thread; NIL outside worker threads.")

;;; The connection a worker holds.

(defun hold-connection (worker connection)
  "WORKER now serves CONNECTION, which no other thread touches until WORKER
lets go of it."
  (setf (worker-connection worker) connection))

(defun let-go-of-connection (worker)
  "WORKER stops holding its connection, before it parks, closes or hands it
over.  The connection it held, or NIL when it held none."
  ;; Only WORKER's thread writes the slot: when it is NIL, no lock is
  ;; needed to tell, and SERVE-CONNECTION asks again after every turn.
  (when (worker-connection worker)
    (bt:with-lock-held ((worker-connection-lock worker))
      (shiftf (worker-connection worker) nil))))

(defun call-with-held-connection (worker function)
  "Call FUNCTION on the connection WORKER holds, if any, while WORKER cannot
let go of it: from another thread, the descriptor stays WORKER's open one."
  (bt:with-lock-held ((worker-connection-lock worker))
    (let ((connection (worker-connection worker)))
      (when connection
        (funcall function connection)))))

;;; Waiting for something to serve, or resting.

(defun step-waiting-count (taskmaster worker step limit state)
  "Add STEP (1 or -1) to the count of waiting workers if that keeps it on
LIMIT's side -- at most LIMIT when joining, at least when leaving -- and set
WORKER's STATE with it.  True when it did."
  (let ((gauges (pool-gauges taskmaster)))
    (declare (type fixnum step limit))
    ;; Once per request: the count is a fixnum and the exit is outside
    ;; WITHOUT-INTERRUPTS's body, so that nothing is consed.
    (loop
      (let ((waiting (pool-gauges-waiting gauges)))
        (declare (type fixnum waiting))
        (unless (if (plusp step) (< waiting limit) (> waiting limit))
          (return nil))
        (when (without-interrupts
                (when (compare-and-swap (pool-gauges-waiting gauges) waiting (+ waiting step))
                  (setf (worker-state worker) state)
                  t))
          (return t))))))

(defconstant +kept-alive-waiting-factor+ 4
  "Workers back from long requests on kept-alive connections join the
waiting while fewer than this many times MAX-WAITING-THREAD-COUNT wait.  On
2 processors (3 waiting), 8, 12 and 16 answered alike at 1 ms and 1,000
connections, 24 fewer.")

(defun waiting-limit (taskmaster worker)
  "How many workers may wait when WORKER joins them, by its last turn:
after a quick request MAX-WAITING-THREAD-COUNT, one fewer when the turn
began with a new connection; after a long request (a millisecond or more)
+KEPT-ALIVE-WAITING-FACTOR+ times it on a kept-alive connection, and any
number on a new one."
  ;; New connections come one at a time, each arming the engine's wait
  ;; again as it is taken: a worker asleep there is woken for each one, to
  ;; take turns with the workers running
  ;; (bench/profiles/2026-11-25-new-connection-waits.txt).  Handlers that
  ;; wait need workers in circulation: a kept-alive connection's bytes queue
  ;; in the engine for a worker back from its handler, each worker more
  ;; asleep in the wait is one woken for them
  ;; (bench/profiles/2026-11-26-waiting-after-long-requests.txt); new
  ;; connections cannot queue so, and a cap there cost an eighth of the
  ;; requests at 1 ms.
  (let ((most (taskmaster-max-waiting-thread-count taskmaster)))
    (cond ((not (worker-last-request-long-p worker))
           (if (worker-last-turn-new-p worker) (max 1 (1- most)) most))
          ((worker-last-turn-new-p worker) most-positive-fixnum)
          (t (* +kept-alive-waiting-factor+ most)))))

(defun join-waiting (taskmaster worker)
  "Count WORKER among the waiting unless WAITING-LIMIT wait already.  True
when WORKER joined."
  (step-waiting-count taskmaster worker 1 (waiting-limit taskmaster worker) :waiting))

(defun count-out-retiring (taskmaster worker)
  "WORKER retires as surplus: out of the pool's count.  POOL-LOCK held,
interrupts deferred, and WORKER counted neither waiting nor resting."
  (setf (worker-state worker) :exiting)
  (decf (pool-thread-count taskmaster))
  (incf (threads-retired taskmaster)))

(defun rest-until-released (taskmaster worker)
  "Rest WORKER on RESTING-WAKEUP until growth releases it (then it is
counted waiting: true), the pool stops, or it has rested THREAD-IDLE-TIMEOUT
seconds while the pool is above standby (then it retires: NIL)."
  (flet ((rest-deadline () (deadline-in (taskmaster-thread-idle-timeout taskmaster))))
    (with-pool-lock (taskmaster)
      (let ((first-wait-p (eq (worker-state worker) :starting)))
        (without-interrupts
          (setf (worker-state worker) :resting)
          (incf (resting-count taskmaster)))
        (when first-wait-p
          (notify-pool-changed taskmaster)))
      (let ((deadline (rest-deadline)))
        (loop
          (cond ((shutting-down-p taskmaster)
                 (without-interrupts
                   (decf (resting-count taskmaster))
                   (setf (worker-state worker) :serving))
                 (return nil))
                ((plusp (released-count taskmaster))
                 (without-interrupts
                   (decf (released-count taskmaster))
                   (decf (resting-count taskmaster))
                   (atomic-increment (pool-gauges-waiting (pool-gauges taskmaster)))
                   (setf (worker-state worker) :waiting))
                 (return t))
                ((< (get-internal-real-time) deadline)
                 (bt:condition-wait (resting-wakeup taskmaster) (pool-lock taskmaster)
                                    :timeout (seconds-until deadline)))
                ((> (pool-thread-count taskmaster) (taskmaster-standby-thread-count taskmaster))
                 ;; No release is pending here: RELEASED-COUNT is zero.
                 (without-interrupts
                   (decf (resting-count taskmaster))
                   (count-out-retiring taskmaster worker))
                 (return nil))
                (t (setf deadline (rest-deadline)))))))))

(defun begin-waiting (taskmaster worker)
  "WORKER is about to wait on the engine for something to serve.  When
MAX-WAITING-THREAD-COUNT workers wait already and its last request was
quick, it rests first, until growth needs it.  True when WORKER is now
counted waiting; NIL when it is to end (the pool stops, or it retired while
resting)."
  (let ((first-wait-p (eq (worker-state worker) :starting)))
    (cond ((join-waiting taskmaster worker)
           ;; Its first wait tells START that it has begun.
           (when first-wait-p
             (with-pool-lock (taskmaster)
               (notify-pool-changed taskmaster)))
           t)
          (t (rest-until-released taskmaster worker)))))

(defun release-resting-worker (taskmaster)
  "Wake one resting worker to wait on the engine: growth, before it makes a
thread.  POOL-LOCK held, and an unreleased resting worker there."
  (incf (released-count taskmaster))
  (bt:condition-notify (resting-wakeup taskmaster)))

(defun note-turn-taken (worker new-connection-p)
  "WORKER, woken, takes up a connection to serve: a new one when
NEW-CONNECTION-P.  Its next JOIN-WAITING counts which."
  (setf (worker-last-turn-new-p worker) new-connection-p))

(defun note-woken (taskmaster worker)
  "WORKER left its wait with something to serve.  If it was the last one
waiting, ask the thread-making thread to weigh another worker
(pool/growth.lisp), waking it only when no weighing is scheduled: one
that is will see the request.  Under load the last waiting worker is woken
hundreds of times a second; a thread-making thread woken, and weighing,
for each cost 0.003 to 0.005 futex calls a request at a 0 ms handler
(bench/profiles/2026-11-26-growth-weighing.txt)."
  (when (and (= 1 (without-interrupts
                    (setf (worker-state worker) :serving)
                    (atomic-decrement (pool-gauges-waiting (pool-gauges taskmaster)))))
             ;; Read without the lock: while a request is being weighed, the
             ;; pool is not locked once per request to make another.
             (not (growth-asked-p taskmaster)))
    (with-pool-state-change (taskmaster)
      (when (and (zerop (waiting-worker-count taskmaster))
                 (not (growth-asked-p taskmaster))
                 (zerop (pending-thread-count taskmaster))
                 (pool-may-grow-p taskmaster))
        (setf (growth-asked-p taskmaster) t)
        (unless (growth-weighing-scheduled-p taskmaster (get-internal-real-time))
          (notify-thread-maker taskmaster))))))

(defun note-stopped-waiting (taskmaster worker)
  "WORKER left its wait because the pool stops."
  (without-interrupts
    (setf (worker-state worker) :serving)
    (atomic-decrement (pool-gauges-waiting (pool-gauges taskmaster)))))

(defun retire-if-surplus (taskmaster worker)
  "Retire WORKER, waiting, when the pool is above standby and another worker
still waits (the last waiting worker never retires, since growth starts
only when a waiting worker is woken).  WORKER leaves the waiting by a
compare-and-swap that never takes their count below one: a worker woken
between a look at the count and a decrement would have seen two waiting,
not asked for growth (NOTE-WOKEN), and left nobody waiting.  True when it
retired."
  (with-pool-state-change (taskmaster)
    (when (and (not (shutting-down-p taskmaster))
               (> (pool-thread-count taskmaster) (taskmaster-standby-thread-count taskmaster))
               (step-waiting-count taskmaster worker -1 1 :serving))
      (count-out-retiring taskmaster worker)
      t)))

(defun leave-waiting-if-above-max (taskmaster worker)
  "Count WORKER out of the waiting when more than MAX-WAITING-THREAD-COUNT
wait (workers back from long requests, or released, joined past it).  True
when it left."
  (step-waiting-count taskmaster worker -1 (taskmaster-max-waiting-thread-count taskmaster) :serving))

(defun note-wait-timed-out (taskmaster worker)
  "WORKER waited THREAD-IDLE-TIMEOUT seconds for nothing: it retires if it
is surplus, else it rests if more than MAX-WAITING-THREAD-COUNT wait.  True
when it is to end; NIL when it is (again) counted waiting."
  (cond ((retire-if-surplus taskmaster worker) t)
        ((leave-waiting-if-above-max taskmaster worker)
         (not (rest-until-released taskmaster worker)))
        (t nil)))

;;; Requests.

(defun note-request-started (taskmaster worker)
  "WORKER has a complete request head.  False when the pool is stopping and
the request is not to be started (STOP sets its flag before it looks for
requests in flight)."
  (setf (worker-state worker) :in-request
        (worker-request-started worker) (monotonic-microseconds))
  (memory-barrier)
  (if (shutting-down-p taskmaster)
      (progn (setf (worker-state worker) :serving) nil)
      t))

(defun request-microseconds-so-far (worker)
  "The microseconds since WORKER started the request it is in, or NIL when
it is in none (it completes a reply a request deferred, say)."
  (and (eq (worker-state worker) :in-request)
       (max 0 (- (monotonic-microseconds) (worker-request-started worker)))))

(defun note-request-finished (taskmaster worker &key answered)
  "WORKER is out of its request: ANSWERED, or left by an error.  The
microseconds the request took."
  (when answered
    (incf (worker-requests-served worker)))
  (let ((microseconds (max 0 (- (monotonic-microseconds) (worker-request-started worker)))))
    (setf (worker-last-request-long-p worker) (long-request-p microseconds)
          (worker-state worker) :serving)
    (memory-barrier)
    (when (shutting-down-p taskmaster)
      ;; A soft STOP waits for the requests in flight.
      (with-pool-lock (taskmaster)
        (notify-pool-changed taskmaster)))
    microseconds))

(defun in-request-count (taskmaster)
  "Workers inside a request, from its head read to its reply sent.  POOL-LOCK held."
  (count :in-request (pool-workers taskmaster) :key #'worker-state))

;;; Ending.

(defun note-worker-exited (taskmaster worker)
  "WORKER's thread is ending, normally or not.  Undo whatever its state still
counts, and ask for a replacement if the pool fell below standby."
  (with-pool-state-change (taskmaster)
    (case (worker-state worker)
      (:exiting)
      (:waiting
       (atomic-decrement (pool-gauges-waiting (pool-gauges taskmaster)))
       (decf (pool-thread-count taskmaster)))
      (:resting
       (decf (resting-count taskmaster))
       (decf (pool-thread-count taskmaster)))
      (t (decf (pool-thread-count taskmaster))))
    (setf (worker-state worker) :exiting)
    (incf (retired-requests-served taskmaster) (worker-requests-served worker))
    (setf (pool-workers taskmaster) (delete worker (pool-workers taskmaster)))
    (when (and (not (shutting-down-p taskmaster))
               (< (+ (pool-thread-count taskmaster) (pending-thread-count taskmaster))
                  (taskmaster-standby-thread-count taskmaster)))
      (incf (pending-thread-count taskmaster)))
    (notify-thread-maker taskmaster)
    (notify-pool-changed taskmaster)))
