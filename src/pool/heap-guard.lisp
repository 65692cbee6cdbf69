;;;; The heap guard.  SBCL's collector collects the youngest generation as
;;;; it fills; what survives it -- a handler's strings of megabytes, caught
;;;; in flight -- moves to older generations, collected far more rarely.
;;;; Under replies built as megabytes at a time that garbage filled the
;;;; demo's heap to 87 % while 130 MB of it was live, and the collector,
;;;; finding no room to move what it keeps, ended the process ("Heap
;;;; exhausted"); so did Hunchentoot's own acceptor.  The thread-making
;;;; thread, at each maintenance, collects every generation when the heap
;;;; holds more than +HEAP-SHARE-TO-COLLECT+ of its size and
;;;; +HEAP-GROWTH-TO-COLLECT+ times what was live after the last such
;;;; collection, at most once a second: a heap kept mostly live by the
;;;; application is never collected so again and again.  One guard for the
;;;; process, whatever its acceptors.
;;;;
;;;; Locking: **HEAP-GUARD**'s fields are written by the thread that wins it
;;;; by compare-and-swap, for the collection it makes.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +heap-share-to-collect+ 2/5
  "The share of the heap's size it must hold for the guard to collect it.")

(defconstant +heap-growth-to-collect+ 3/2
  "How many times what was live after its last collection the heap must
hold for the guard to collect it.  Twice let 300 clients of 1 MB replies
fill the demo's heap past 60 % (a CI run of bench/run memory), while a
hundred handlers each held megabytes live.")

(defconstant +heap-collection-interval-seconds+ 1
  "The least time between two collections of the guard.")

(defstruct (heap-guard (:constructor make-heap-guard ()))
  ;; True while a thread collects for the guard.
  (busy-p nil)
  ;; Internal real time of its last collection, and the octets live after it.
  (collected-at nil)
  (live-octets 0 :type word)
  ;; Its collections, ever.
  (collections 0 :type word))

(sb-ext:define-load-time-global **heap-guard** (make-heap-guard)
  "The process's heap guard.")

(defun heap-collection-due-p (guard used now)
  "True when GUARD is to collect a heap of USED octets at internal real
time NOW."
  (and (> used (* +heap-share-to-collect+ (heap-octets)))
       (> used (* +heap-growth-to-collect+ (heap-guard-live-octets guard)))
       (let ((collected-at (heap-guard-collected-at guard)))
         (or (null collected-at)
             (>= (- now collected-at) (* +heap-collection-interval-seconds+ internal-time-units-per-second))))))

(defun guard-heap (&optional (guard **heap-guard**))
  "Collect every generation when GUARD says it is due (see above); true
when this call collected."
  (when (and (heap-collection-due-p guard (heap-octets-used) (get-internal-real-time))
             (compare-and-swap (heap-guard-busy-p guard) nil t))
    (unwind-protect
         (progn (collect-every-generation)
                (setf (heap-guard-live-octets guard) (heap-octets-used)
                      (heap-guard-collected-at guard) (get-internal-real-time))
                (atomic-increment (heap-guard-collections guard))
                t)
      (setf (heap-guard-busy-p guard) nil))))
