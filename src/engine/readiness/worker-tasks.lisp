;;;; Tasks any worker may run, which are no connection's turn: the handler
;;;; of an HTTP/2 stream, whose connection goes on being read meanwhile; and
;;;; the tokens a worker's wait reported beyond the one it serves
;;;; (NEXT-READY-TOKEN), each a connection or the listening socket that any
;;;; worker may take up as if the set had reported it to it.
;;;;
;;;; A task waits in the set's queue.  Every worker takes tasks from it before
;;;; it waits on the set again (RUN-QUEUED-TASKS), so that the worker that
;;;; read a connection's streams answers them itself, in order, without waking
;;;; another: waking a worker a stream cost more than the stream
;;;; (bench/profiles/2026-11-28-http2.txt); and so that the connections one
;;;; wait reported are served by it in turn, one epoll_wait for many.  A slow
;;;; handler must not hold up the tasks behind it, though: a task queued arms
;;;; a nudge, called +TASK-NUDGE-MILLISECONDS+ later.  If a task queued before
;;;; the nudge was armed still waits then, the queue is held up: the nudge
;;;; makes the task eventfd readable; the worker it wakes takes one, and makes
;;;; it readable again while more wait, so that each waiting task soon has a
;;;; worker, and the pool grows when none waits (ENGINE-WORK-WAITING-P sees
;;;; the eventfd).  If all those were taken and only newer tasks wait, the
;;;; workers keep up with the queue: the nudge is armed again for the newer
;;;; ones, and no worker is woken.  Under steady load the queue is refilled as
;;;; fast as it is served, never empty for long; waking a worker each time it
;;;; was not was an eventfd written and read, a descriptor armed and a thread
;;;; switch every millisecond
;;;; (bench/profiles/2026-11-29-reply-head-octets.txt).  The counts of tasks
;;;; queued and taken tell which tasks are older than the nudge: taken in
;;;; order, but for the tokens the sweep takes out of it, after which the
;;;; functions left count as the newest, waiting one nudge more at most.  The
;;;; eventfd is watched one-shot; the worker it wakes clears it and arms it
;;;; again.  While no worker is free the sweep takes the queued tokens instead
;;;; (TAKE-QUEUED-TOKENS), as it takes what the set reports.
;;;;
;;;; CALL-SOON defers a call, such as the nudge, briefly: one timer for all
;;;; the calls due within +TASK-NUDGE-MILLISECONDS+.
;;;;
;;;; TASKS-LOCK guards the queue, the calls and their flags, never held
;;;; while a task or a call runs.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +task-nudge-milliseconds+ 1
  "How long the oldest tasks of the queue may wait, not taken, before a
worker is woken for them: a task waits at most twice this before one is.")

(defun call-soon (set function)
  "Call FUNCTION, without arguments, in a worker within
+TASK-NUDGE-MILLISECONDS+, with the other calls due then, by one timer."
  (let ((schedule-p nil))
    (bt:with-lock-held ((readiness-set-tasks-lock set))
      (push function (readiness-set-soon-calls set))
      (unless (readiness-set-soon-timer-p set)
        (setf (readiness-set-soon-timer-p set) t
              schedule-p t)))
    (when schedule-p
      (schedule-timer (readiness-set-timers set) +task-nudge-milliseconds+ (lambda () (run-soon-calls set))))))

(defun run-soon-calls (set)
  "Call what CALL-SOON was given, oldest first."
  (mapc #'funcall (reverse (bt:with-lock-held ((readiness-set-tasks-lock set))
                             (setf (readiness-set-soon-timer-p set) nil)
                             (shiftf (readiness-set-soon-calls set) '())))))

(defun queue-worker-tasks (set tasks)
  "Add TASKS, in order, to SET's queue, from any thread; a worker runs each
(RUN-WORKER-TASK).  A task is a function of the worker's SERVING, or the
token of a connection or of the listening socket that the set reported."
  (when tasks
    (let ((nudge-p nil))
      (bt:with-lock-held ((readiness-set-tasks-lock set))
        (if (readiness-set-tasks set)
            (setf (cdr (readiness-set-tasks-tail set)) tasks)
            (setf (readiness-set-tasks set) tasks))
        (setf (readiness-set-tasks-tail set) (last tasks))
        (incf (readiness-set-tasks-queued set) (length tasks))
        (unless (readiness-set-task-nudge-p set)
          (setf (readiness-set-task-nudge-p set) t
                (readiness-set-task-nudge-mark set) (readiness-set-tasks-queued set)
                nudge-p t)))
      (when nudge-p
        (call-soon set (lambda () (nudge-task-workers set)))))))

(defun nudge-task-workers (set)
  "The nudge: wake a worker for the tasks waiting in SET's queue when one
queued before the nudge was armed is among them; when only newer ones
wait, arm the nudge again for them (see above)."
  (case (bt:with-lock-held ((readiness-set-tasks-lock set))
          (cond ((null (readiness-set-tasks set))
                 (setf (readiness-set-task-nudge-p set) nil))
                ((< (readiness-set-tasks-taken set) (readiness-set-task-nudge-mark set))
                 (setf (readiness-set-task-nudge-p set) nil)
                 :held-up)
                (t
                 (setf (readiness-set-task-nudge-mark set) (readiness-set-tasks-queued set))
                 :kept-up)))
    (:held-up (signal-wakeup-fd (readiness-set-task-fd set)))
    (:kept-up (call-soon set (lambda () (nudge-task-workers set))))))

(defun pop-worker-task (set)
  "The oldest task of SET's queue, taken, or NIL; second value, true when
more wait."
  (bt:with-lock-held ((readiness-set-tasks-lock set))
    (let ((task (pop (readiness-set-tasks set))))
      (when task
        (incf (readiness-set-tasks-taken set)))
      (values task (and (readiness-set-tasks set) t)))))

(defun take-woken-task (set)
  "For the worker the task eventfd woke: the oldest task, or NIL when
others took them all; the eventfd is cleared and armed again, readable
again first while more tasks wait, for the next worker."
  (clear-timer-fd (readiness-set-task-fd set))
  (multiple-value-bind (task more-p) (pop-worker-task set)
    (when more-p
      (signal-wakeup-fd (readiness-set-task-fd set)))
    (rearm-own-descriptor set +task-token+)
    task))

(defun take-queued-tokens (set)
  "The tokens waiting in SET's queue, oldest first, taken out of it; its
functions stay."
  (bt:with-lock-held ((readiness-set-tasks-lock set))
    (let ((tokens (remove-if-not #'integerp (readiness-set-tasks set))))
      (when tokens
        (let ((functions (delete-if #'integerp (readiness-set-tasks set))))
          (setf (readiness-set-tasks set) functions
                (readiness-set-tasks-tail set) (last functions)
                (readiness-set-tasks-taken set) (- (readiness-set-tasks-queued set) (length functions)))))
      tokens)))
