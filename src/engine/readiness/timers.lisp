;;;; Timers on the readiness set's own clock: a call due after some
;;;; milliseconds, made by whichever worker the set's timerfd wakes, so
;;;; that a wait costs an entry in a heap, never a thread.  The timerfd is
;;;; set for the earliest deadline in the heap and watched one-shot: the
;;;; worker it wakes clears it, takes every timer due, sets it for the next
;;;; and arms it again before it calls them (a timer added meanwhile for an
;;;; earlier time sets the descriptor itself).
;;;;
;;;; LOCK guards the heap and the deadline the descriptor is set for; it is
;;;; never held while a timer's function runs.

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (timer (:constructor make-timer (deadline function)))
  "A call of FUNCTION, without arguments, due at DEADLINE."
  ;; MONOTONIC-MICROSECONDS.
  (deadline 0 :type fixnum :read-only t)
  (function nil :type function :read-only t)
  ;; True once CANCEL-TIMER was called: it is dropped when due.
  (cancelled-p nil))

(defstruct (timers (:constructor %make-timers (fd)))
  "The timers of one readiness set."
  ;; The timerfd, in the set's epoll instance under +TIMER-TOKEN+.
  (fd -1 :type fixnum :read-only t)
  (lock (bt:make-lock "timers") :read-only t)
  ;; A binary heap of TIMERs by deadline, its first COUNT entries.
  (heap (make-array 64 :initial-element nil) :type simple-vector)
  (count 0 :type fixnum)
  ;; What the descriptor is set for: the heap's earliest deadline, or
  ;; MOST-POSITIVE-FIXNUM while it is set for nothing.
  (set-for most-positive-fixnum :type fixnum)
  ;; Timers that have been called since the set was made.
  (fired-count 0 :type word))

(defun make-timers ()
  (%make-timers (make-timer-fd)))

(defun destroy-timers (timers)
  (close-fd (timers-fd timers)))

;;; The heap: the parent of entry I is (I-1)/2.

(defun timer-before-p (heap i j)
  (< (timer-deadline (svref heap i)) (timer-deadline (svref heap j))))

(defun sift-up (heap index)
  (loop while (plusp index)
        do (let ((parent (floor (1- index) 2)))
             (unless (timer-before-p heap index parent)
               (return))
             (rotatef (svref heap index) (svref heap parent))
             (setf index parent))))

(defun sift-down (heap index count)
  (loop
    (let* ((left (1+ (* 2 index)))
           (right (1+ left))
           (least index))
      (when (and (< left count) (timer-before-p heap left least))
        (setf least left))
      (when (and (< right count) (timer-before-p heap right least))
        (setf least right))
      (when (= least index)
        (return))
      (rotatef (svref heap index) (svref heap least))
      (setf index least))))

(defun push-timer (timers timer)
  "Add TIMER to the heap; LOCK held."
  (let ((count (timers-count timers)))
    (when (= count (length (timers-heap timers)))
      (setf (timers-heap timers) (replace (make-array (* 2 count) :initial-element nil) (timers-heap timers))))
    (setf (svref (timers-heap timers) count) timer
          (timers-count timers) (1+ count))
    (sift-up (timers-heap timers) count)))

(defun pop-timer (timers)
  "Take the earliest timer from the heap, which has one; LOCK held."
  (let* ((heap (timers-heap timers))
         (count (1- (timers-count timers)))
         (first (svref heap 0)))
    (setf (svref heap 0) (svref heap count)
          (svref heap count) nil
          (timers-count timers) count)
    (sift-down heap 0 count)
    first))

(defun set-timers-fd (timers)
  "Set the descriptor for the heap's earliest deadline, if it is not set
for it already; LOCK held."
  (let ((earliest (if (plusp (timers-count timers))
                      (timer-deadline (svref (timers-heap timers) 0))
                      most-positive-fixnum)))
    (unless (= earliest (timers-set-for timers))
      (setf (timers-set-for timers) earliest)
      (set-timer-fd (timers-fd timers) (and (< earliest most-positive-fixnum) earliest)))))

;;; From any thread.

(defun schedule-timer (timers milliseconds function)
  "Call FUNCTION, in a worker, MILLISECONDS from now; the TIMER."
  (let ((timer (make-timer (+ (monotonic-microseconds) (round (* milliseconds 1000))) function)))
    (bt:with-lock-held ((timers-lock timers))
      (push-timer timers timer)
      (set-timers-fd timers))
    timer))

(defun cancel-timer (timer)
  "Make TIMER's call not happen, unless it has begun."
  (setf (timer-cancelled-p timer) t))

(defun pending-timer-count (timers)
  (timers-count timers))

;;; In the worker woken for the descriptor.

(defun take-due-timers (timers)
  "Clear the descriptor and take every timer due, not cancelled, earliest
first; the descriptor is set for the next."
  (clear-timer-fd (timers-fd timers))
  (let ((now (monotonic-microseconds))
        (due '()))
    (bt:with-lock-held ((timers-lock timers))
      (loop while (and (plusp (timers-count timers))
                       (<= (timer-deadline (svref (timers-heap timers) 0)) now))
            do (let ((timer (pop-timer timers)))
                 (unless (timer-cancelled-p timer)
                   (push timer due))))
      ;; Set for the next, and for the same deadline again if a worker
      ;; woke before it (the clock read here is a little behind the fd's).
      (setf (timers-set-for timers) -1)
      (set-timers-fd timers))
    (nreverse due)))
