;;;; Starting, stopping and abandoning the pool.  STOP interrupts no thread:
;;;; it wakes waiting workers through the engine, shuts down the sockets of
;;;; workers that wait on a client, and waits, within :STOP-TIMEOUT, for
;;;; every worker to end by itself.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +standby-start-seconds+ 10
  "How long START waits for the standby workers to begin waiting before it
calls the pool corrupted.")

(defun signal-corrupted (taskmaster description)
  "Signal RECYCLING-TASKMASTER-CORRUPTED-ERROR.  Its restart abandons the
acceptor and leaves the START or STOP under way, whose :AROUND method on
PARALLEL-ACCEPTOR catches ACCEPTOR-ABANDONED."
  (restart-case (error 'recycling-taskmaster-corrupted-error
                       :taskmaster taskmaster :description description)
    (abandon-acceptor ()
      :report "Abandon the acceptor: end every worker by force and close its socket."
      (abandon-acceptor (hunchentoot:taskmaster-acceptor taskmaster))
      (throw 'acceptor-abandoned nil))))

;;; START.

(defun reset-pool (taskmaster)
  (with-pool-state-change (taskmaster)
    (setf (shutting-down-p taskmaster) nil
          (soft-stop-p taskmaster) nil
          (pending-thread-count taskmaster) (taskmaster-standby-thread-count taskmaster)
          (growth-asked-p taskmaster) nil
          (released-count taskmaster) 0
          (growth-weighing-interval taskmaster) 0
          (next-growth-weighing taskmaster) 0)))

(defun taskmaster-engine-for (taskmaster)
  "TASKMASTER's engine, made the first time it is asked for."
  (or (taskmaster-engine taskmaster)
      (setf (taskmaster-engine taskmaster)
            (make-connection-engine taskmaster))))

(defun standby-threads-started-p (taskmaster)
  "True when the standby workers exist and each has begun taking work.  Not
that they all wait: under load some already serve.  POOL-LOCK held."
  (and (zerop (pending-thread-count taskmaster))
       (>= (pool-thread-count taskmaster) (taskmaster-standby-thread-count taskmaster))
       (notany (lambda (worker) (eq (worker-state worker) :starting))
               (pool-workers taskmaster))))

(defun stop-listening-after-failed-start (acceptor)
  "START has already listened: leave the port free for a retry."
  (ignore-errors (usocket:socket-close (acceptor-listen-socket acceptor)))
  (setf (acceptor-listen-socket acceptor) nil))

(defmethod hunchentoot:execute-acceptor ((taskmaster recycling-taskmaster))
  (let ((acceptor (hunchentoot:taskmaster-acceptor taskmaster)))
    (unless (typep acceptor 'parallel-acceptor)
      (stop-listening-after-failed-start acceptor)
      (error 'acceptor-not-parallel-error :acceptor acceptor))
    (when (pool-workers taskmaster)
      (signal-corrupted taskmaster (format nil "~D worker threads from an earlier run are still alive."
                                           (length (pool-workers taskmaster)))))
    (reset-pool taskmaster)
    ;; A certificate that does not load, say.
    (handler-bind ((error (lambda (condition)
                            (declare (ignore condition))
                            (stop-listening-after-failed-start acceptor))))
      (engine-start (taskmaster-engine-for taskmaster)))
    (start-thread-maker taskmaster)
    (with-pool-lock (taskmaster) (notify-thread-maker taskmaster))
    (unless (wait-for-pool taskmaster (lambda () (standby-threads-started-p taskmaster))
                           (deadline-in +standby-start-seconds+))
      (signal-corrupted taskmaster (format nil "the standby workers did not start within ~D seconds."
                                           +standby-start-seconds+)))
    taskmaster))

;;; STOP.

(defun begin-shutdown (taskmaster)
  (with-pool-state-change (taskmaster)
    (setf (shutting-down-p taskmaster) t)
    (notify-thread-maker taskmaster)
    (condition-broadcast (resting-wakeup taskmaster))
    (notify-pool-changed taskmaster)))

(defun cut-waits-on-clients (taskmaster &key spare-requests-p)
  "Cut what each worker waits on its client for: the TLS handshake under
way on the connection it holds, and, unless SPARE-REQUESTS-P, the request
in flight, whose handler may read or write its connection.  A worker
holding a connection otherwise is left to end its turn: the engine's code
there never waits on a client, and a websocket's handler, which a cut
would not stop either, would then find its client cut off before its close
frame; the connection is closed as STOP closes every connection once that
worker parks it or lets go of it.  A worker entering a request once the
pool is stopping does not start it (NOTE-REQUEST-STARTED)."
  (let ((engine (taskmaster-engine taskmaster)))
    (dolist (worker (with-pool-lock (taskmaster) (copy-list (pool-workers taskmaster))))
      (if (and (eq (worker-state worker) :in-request) (not spare-requests-p))
          (engine-cut-connection engine worker)
          (engine-cut-handshake engine worker)))))

(defun join-within (taskmaster threads deadline)
  "Join each of THREADS by DEADLINE (with a moment's grace for threads that
have left the pool and only return).  Signals the pool corrupted when one
does not end."
  (let* ((join-deadline (max deadline (deadline-in 1/20)))
         (alive (remove-if (lambda (thread) (join-thread-within thread (seconds-until join-deadline)))
                           threads)))
    (when alive
      (signal-corrupted taskmaster (format nil "~D threads left the pool but did not end by STOP's deadline."
                                           (length alive))))))

(defmethod hunchentoot:shutdown ((taskmaster recycling-taskmaster))
  "End the pool within STOP-TIMEOUT: stop taking work, close idle
connections, let requests in flight finish when the stop is soft (cut their
connections when it is hard, or when the time is up), cut TLS handshakes
under way, and join every thread."
  (shut-down-by taskmaster (deadline-in (taskmaster-stop-timeout taskmaster))))

(defun shut-down-by (taskmaster deadline)
  "HUNCHENTOOT:SHUTDOWN of TASKMASTER, done by DEADLINE (internal real time)."
  (let ((engine (taskmaster-engine taskmaster))
        (threads (with-pool-lock (taskmaster)
                   (remove nil (mapcar #'worker-thread (pool-workers taskmaster))))))
    (begin-shutdown taskmaster)
    (engine-wake-workers engine)
    (engine-close-idle-connections engine)
    (when (soft-stop-p taskmaster)
      (cut-waits-on-clients taskmaster :spare-requests-p t)
      (wait-for-pool taskmaster (lambda () (zerop (in-request-count taskmaster))) deadline))
    (cut-waits-on-clients taskmaster)
    (unless (wait-for-pool taskmaster (lambda () (null (pool-workers taskmaster))) deadline)
      (signal-corrupted taskmaster (format nil "~D worker threads did not end within ~A seconds of STOP."
                                           (length (pool-workers taskmaster))
                                           (taskmaster-stop-timeout taskmaster))))
    (join-within taskmaster (remove nil (list* (shiftf (thread-maker taskmaster) nil) threads)) deadline)
    (engine-finish engine)
    taskmaster))

;;; The forced teardown.

(defun end-threads-by-force (threads)
  "BT:DESTROY-THREAD each of THREADS but the calling one, then join each,
waiting up to 2 s for it."
  (let ((threads (remove (bt:current-thread) (remove nil threads))))
    (dolist (thread threads)
      (ignore-errors (bt:destroy-thread thread)))
    (dolist (thread threads)
      (join-thread-within thread 2))))

(defun abandon-pool (taskmaster)
  "End every thread of TASKMASTER by force, close every connection, and
forget them.  The thread-making thread ends first: a worker it made after
the workers were listed would outlive the pool, and its exit would count
below zero."
  (with-pool-state-change (taskmaster)
    (setf (shutting-down-p taskmaster) t))
  (end-threads-by-force (list (thread-maker taskmaster)))
  (let ((workers (with-pool-lock (taskmaster) (copy-list (pool-workers taskmaster)))))
    ;; A worker made just before the maker ended records its thread as it starts.
    (loop repeat 200
          while (some (lambda (worker) (null (worker-thread worker))) workers)
          do (sleep 0.01))
    (end-threads-by-force (mapcar #'worker-thread workers)))
  (when (taskmaster-engine taskmaster)
    (engine-abandon (taskmaster-engine taskmaster)))
  (with-pool-state-change (taskmaster)
    (setf (pool-workers taskmaster) '()
          (thread-maker taskmaster) nil
          (pool-thread-count taskmaster) 0
          (pending-thread-count taskmaster) 0
          (growth-asked-p taskmaster) nil
          (resting-count taskmaster) 0
          (released-count taskmaster) 0
          (pool-gauges-waiting (pool-gauges taskmaster)) 0)
    (notify-pool-changed taskmaster)))

;;; The acceptor's side.

(defmethod hunchentoot:start :around ((acceptor parallel-acceptor))
  (catch 'acceptor-abandoned
    (call-next-method))
  acceptor)

(defmethod hunchentoot:stop :around ((acceptor parallel-acceptor) &key soft)
  (declare (ignore soft))
  (when (hunchentoot:started-p acceptor)
    (catch 'acceptor-abandoned
      (call-next-method)))
  acceptor)

(defmethod hunchentoot:stop ((acceptor parallel-acceptor) &key soft)
  "Hunchentoot's STOP, bounded: its soft stop waits for requests in flight
without a deadline, and it wakes the listener with a connection of its own.
Here the taskmaster does both, within its STOP-TIMEOUT.  A soft stop first
stops accepting and lets connections already accepted send and get their
first request (ENGINE-DRAIN, half the STOP-TIMEOUT at most)."
  (let ((taskmaster (recycling-taskmaster-of acceptor)))
    (if (null taskmaster)
        (call-next-method)
        (let ((deadline (deadline-in (taskmaster-stop-timeout taskmaster))))
          (when soft
            ;; Half of the stop's time at most, so that the rest of STOP
            ;; has the other half.
            (engine-drain (taskmaster-engine taskmaster)
                          (deadline-in (/ (taskmaster-stop-timeout taskmaster) 2))))
          (setf (acceptor-shutting-down-p acceptor) t
                (soft-stop-p taskmaster) soft)
          (shut-down-by taskmaster deadline)
          (release-listen-socket acceptor)))))

(defun abandon-acceptor (acceptor)
  "Tear ACCEPTOR down by force, for when HUNCHENTOOT:STOP cannot: every
worker thread and the thread-making thread are ended with
BT:DESTROY-THREAD (their UNWIND-PROTECT cleanups run, in-flight requests are
cut off), every connection and the listening socket are closed, and the
port can be listened on again at once.  The acceptor can be started again
afterwards.  Safe to call on an acceptor that is stopped or half-started.
Returns ACCEPTOR.  Unspecified: what a client whose request was cut off
receives, and whether a lock that a destroyed thread held inside foreign
code (malloc, OpenSSL) is ever released."
  (setf (acceptor-shutting-down-p acceptor) t)
  (let ((taskmaster (recycling-taskmaster-of acceptor)))
    (when taskmaster
      (abandon-pool taskmaster)))
  (release-listen-socket acceptor)
  acceptor)
