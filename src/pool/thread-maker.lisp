;;;; The threads: a worker's thread body, and the one thread-making thread,
;;;; which makes every worker (one at a time, so that a burst of wake-ups
;;;; asks for threads without stampeding) and runs the engine's periodic
;;;; maintenance.

(in-package #:hunchentoot-recycling-taskmaster)

(defun run-worker (taskmaster worker)
  "The body of WORKER's thread: serve through the engine until told to end."
  (setf (worker-thread worker) (bt:current-thread))
  (let ((policy (taskmaster-worker-scheduling-policy taskmaster)))
    (unless (or (null policy) (set-current-thread-scheduling-policy policy))
      (log-safely (hunchentoot:taskmaster-acceptor taskmaster)
                  :warning "a worker could not take the scheduling policy ~S" policy)))
  (let ((*worker* worker))
    (unwind-protect
         (engine-run-worker (taskmaster-engine taskmaster) worker)
      (note-worker-exited taskmaster worker))))

(defun worker-thread-name (taskmaster)
  (format nil "hunchentoot-recycling-worker ~A" (taskmaster-acceptor-name taskmaster)))

(defun note-worker-made (taskmaster worker)
  (with-pool-state-change (taskmaster)
    (decf (pending-thread-count taskmaster))
    (push worker (pool-workers taskmaster))
    (incf (pool-thread-count taskmaster))
    (incf (threads-created taskmaster))
    (setf (peak-thread-count taskmaster)
          (max (peak-thread-count taskmaster) (pool-thread-count taskmaster)))))

(defun note-worker-not-made (taskmaster worker)
  "The system refused WORKER's thread.  The request for it stands, to be
weighed again: the worker that asked found nobody else waiting, and may be
in a handler that blocks."
  (with-pool-state-change (taskmaster)
    (setf (pool-workers taskmaster) (delete worker (pool-workers taskmaster)))
    (decf (pool-thread-count taskmaster))
    (setf (growth-asked-p taskmaster) t)
    (notify-pool-changed taskmaster)))

(defun make-worker-thread (taskmaster)
  "Make one worker, counted in the pool before its thread runs.  When the
system refuses a thread, log it and pause, so as not to spin on it."
  (let ((worker (make-worker taskmaster)))
    (note-worker-made taskmaster worker)
    (handler-case
        (setf (worker-thread worker)
              (hunchentoot:start-thread taskmaster
                                        (lambda () (run-worker taskmaster worker))
                                        :name (worker-thread-name taskmaster)))
      (error (condition)
        (note-worker-not-made taskmaster worker)
        (log-safely (hunchentoot:taskmaster-acceptor taskmaster)
                    :error "could not make a worker thread: ~A" condition)
        (sleep 0.1)))))

(defun next-maker-task (taskmaster maintenance-deadline)
  "Wait for the thread-making thread's next task: :EXIT, :MAKE-THREAD,
:WEIGH-GROWTH when a worker asked for another and its weighing is due, or
:MAINTAIN once MAINTENANCE-DEADLINE (internal real time) has passed."
  (with-pool-lock (taskmaster)
    (loop
      (let* ((now (get-internal-real-time))
             (growth-at (growth-wakeup-time taskmaster now)))
        (cond ((shutting-down-p taskmaster) (return :exit))
              ((plusp (pending-thread-count taskmaster)) (return :make-thread))
              ((and growth-at (>= now growth-at)) (return :weigh-growth))
              ((>= now maintenance-deadline) (return :maintain))
              (t (bt:condition-wait (maker-wakeup taskmaster) (pool-lock taskmaster)
                                    :timeout (seconds-until (min maintenance-deadline
                                                                 (or growth-at maintenance-deadline))))))))))

(defun run-thread-maker (taskmaster)
  (let* ((engine (taskmaster-engine taskmaster))
         (interval (engine-maintenance-interval engine))
         (maintenance-deadline (deadline-in interval)))
    (unwind-protect
         (loop
           (ecase (next-maker-task taskmaster maintenance-deadline)
             (:exit (return))
             (:make-thread (make-worker-thread taskmaster))
             (:weigh-growth (weigh-growth taskmaster))
             (:maintain (engine-maintain engine)
                        (guard-heap)
                        (setf maintenance-deadline (deadline-in interval)))))
      ;; The gauge is this thread's; the next START's maker makes another.
      (let ((gauge (shiftf (pool-idle-gauge taskmaster) nil)))
        (when gauge
          (close-idle-gauge gauge))))))

(defun start-thread-maker (taskmaster)
  (setf (thread-maker taskmaster)
        (hunchentoot:start-thread taskmaster (lambda () (run-thread-maker taskmaster))
                                  :name (format nil "hunchentoot-recycling-thread-maker ~A"
                                                (taskmaster-acceptor-name taskmaster)))))
