;;;; Every use of SBCL's thread internals (sb-thread, sb-sys, sb-ext atomics
;;;; and exit hooks) lives in this file, so that the next SBCL breaks in one place.
;;;; bordeaux-threads 0.8.8 has no broadcast, no timed join and no atomics.

(in-package #:hunchentoot-recycling-taskmaster)

(deftype word () 'sb-ext:word)

(defmacro without-interrupts (&body body)
  "Run BODY with interrupts deferred, so that BT:DESTROY-THREAD (which only
ABANDON-ACCEPTOR uses) cannot leave a pool state change half done."
  `(sb-sys:without-interrupts ,@body))

(defun condition-broadcast (condition-variable)
  "Wake every thread waiting on CONDITION-VARIABLE."
  (sb-thread:condition-broadcast condition-variable))

(defun join-thread-within (thread seconds)
  "Join THREAD, giving up after SECONDS (at least a moment).  True when it ended."
  (multiple-value-bind (result problem)
      (sb-thread:join-thread thread :default nil :timeout (max seconds 0.001))
    (declare (ignore result))
    (not (eq problem :timeout))))

(defmacro memory-barrier ()
  "Order this thread's earlier writes before its later reads, which x86-64
does not do by itself.  There, a locked instruction orders them as MFENCE
does for ordinary memory (Intel's SDM, volume 3A, Memory Ordering in P6 and
More Recent Processor Families; AMD's manual says the same), and costs a
quarter of it: 5 ns against 20 here, at three a kept-alive request
(bench/profiles/2026-12-02-locked-barrier.txt).  Linux's smp_mb() on x86-64
is the same locked no-op on a word of the stack.  Elsewhere an atomic
operation need not order unrelated accesses, and SBCL's full barrier is
used."
  #+x86-64 `(let ((word (list nil)))
              (declare (dynamic-extent word))
              (sb-ext:compare-and-swap (car word) nil nil)
              (values))
  #-x86-64 `(sb-thread:barrier (:memory)))

(defmacro write-barrier ()
  "Order this thread's earlier writes before its later writes, so that a
thread that sees the later sees the earlier (with READ-BARRIER)."
  `(sb-thread:barrier (:write)))

(defmacro read-barrier ()
  "Order this thread's earlier reads before its later reads."
  `(sb-thread:barrier (:read)))

(defmacro atomic-increment (place)
  "Add one to PLACE, a structure slot of type WORD; returns the old value."
  `(sb-ext:atomic-incf ,place))

(defmacro atomic-add (place amount)
  "Add AMOUNT to PLACE, a structure slot of type WORD; returns the old value."
  `(sb-ext:atomic-incf ,place ,amount))

(defmacro atomic-subtract (place amount)
  "Subtract AMOUNT from PLACE, a structure slot of type WORD; returns the old value."
  `(sb-ext:atomic-decf ,place ,amount))

(defmacro atomic-decrement (place)
  "Subtract one from PLACE, a structure slot of type WORD; returns the old value."
  `(sb-ext:atomic-decf ,place))

(defmacro compare-and-swap (place old new)
  "Set PLACE, a structure slot of type T or WORD or an INSTANCE-SLOT-VALUE,
to NEW if it is EQ to OLD.  True when it was."
  (let ((old-value (gensym "OLD")))
    `(let ((,old-value ,old))
       (eq ,old-value (sb-ext:compare-and-swap ,place ,old-value ,new)))))

(defun online-processor-count ()
  "The processors online, as sysconf(3) counts them; 1 if it cannot tell."
  (let ((count (sb-alien:alien-funcall
                (sb-alien:extern-alien "sysconf" (function sb-alien:long sb-alien:int))
                +sc-nprocessors-onln+)))
    (if (plusp count) count 1)))

(defun set-current-thread-scheduling-policy (policy)
  "Give the calling thread POLICY, :BATCH or :OTHER (sched(7)'s SCHED_BATCH
and SCHED_OTHER, at priority 0, which needs no privilege).  True when the
kernel took it."
  (sb-alien:with-alien ((priority sb-alien:int 0))
    (zerop (sb-alien:alien-funcall
            (sb-alien:extern-alien "sched_setscheduler"
                                   (function sb-alien:int sb-alien:int sb-alien:int (* sb-alien:int)))
            0 (ecase policy (:batch +sched-batch+) (:other +sched-other+)) (sb-alien:addr priority)))))

(defun call-at-exit (function-name)
  "Have the function FUNCTION-NAME called when the process exits by
SB-EXT:EXIT (SIGTERM's default, the end of a script), after the main
thread has unwound; once however often this is asked."
  (pushnew function-name sb-ext:*exit-hooks*))
