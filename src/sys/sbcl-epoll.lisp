;;;; The readiness set's system calls: epoll(7), an eventfd(2) to wake its
;;;; waiters, and a timerfd(2) that reports the next timer due.

(in-package #:hunchentoot-recycling-taskmaster)

(defun make-epoll-set ()
  "A new epoll(7) instance; its file descriptor."
  (let ((fd (sb-alien:alien-funcall
             (sb-alien:extern-alien "epoll_create1" (function sb-alien:int sb-alien:int))
             +epoll-cloexec+)))
    (when (minusp fd) (foreign-error "epoll_create1"))
    fd))

(defun epoll-control (epoll-fd operation fd token events)
  "epoll_ctl(2).  True on success; false when FD is gone (EBADF, ENOENT)."
  (sb-alien:with-alien ((event (array (sb-alien:unsigned 8) #.+epoll-event-bytes+)))
    (let ((sap (sb-alien:alien-sap event)))
      (setf (sb-sys:sap-ref-32 sap 0) events
            (sb-sys:sap-ref-64 sap +epoll-data-offset+) token)
      (zerop (sb-alien:alien-funcall
              (sb-alien:extern-alien "epoll_ctl" (function sb-alien:int sb-alien:int sb-alien:int
                                                           sb-alien:int sb-sys:system-area-pointer))
              epoll-fd operation fd sap)))))

(defun epoll-events (awaited trigger)
  "The events mask for AWAITED (:INPUT, :OUTPUT, :NONE for errors alone)
reported as TRIGGER says:
:LEVEL while ready, :ONE-SHOT once until armed again, :EDGE each time it
becomes ready (new octets, new room)."
  (logior (ecase awaited
            (:input (logior +epollin+ +epollrdhup+))
            (:output +epollout+)
            (:none 0))
          (ecase trigger
            (:level 0)
            (:one-shot +epolloneshot+)
            (:edge +epollet+))))

(defun epoll-watch (epoll-fd fd token &key (trigger :level) (awaited :input))
  "Add FD to the set: readable (or hung up) reports TOKEN, or writable when
AWAITED is :OUTPUT, as TRIGGER says (EPOLL-EVENTS)."
  (epoll-control epoll-fd +epoll-ctl-add+ fd token (epoll-events awaited trigger)))

(defun epoll-rearm (epoll-fd fd token &key (awaited :input) (trigger :one-shot))
  "Arm FD again, for input or for output as AWAITED says: a one-shot FD is
reported once more; an edge-triggered one is reported at once if it is
ready, as at each edge after."
  (epoll-control epoll-fd +epoll-ctl-mod+ fd token (epoll-events awaited trigger)))

(defun epoll-disarm (epoll-fd fd token)
  "Keep FD in the set but report nothing for it until it is armed again,
but an error or a hang-up, which epoll reports whatever the mask says."
  (epoll-control epoll-fd +epoll-ctl-mod+ fd token 0))

(defun epoll-forget (epoll-fd fd)
  "Take FD out of the set: nothing is reported for it any more, a hang-up
included, and arming it again fails."
  (epoll-control epoll-fd +epoll-ctl-del+ fd 0 0))

(defun epoll-wait-into (epoll-fd milliseconds sap capacity)
  "epoll_wait(2) for up to CAPACITY events into the memory at SAP, waiting up
to MILLISECONDS: how many were reported (at least one), :TIMEOUT, or
:INTERRUPTED (EINTR: SBCL stops every thread with a signal for garbage
collection several times a second, and interrupts arrive the same way)."
  (let ((count (sb-alien:alien-funcall
                (sb-alien:extern-alien "epoll_wait" (function sb-alien:int sb-alien:int
                                                              sb-sys:system-area-pointer
                                                              sb-alien:int sb-alien:int))
                epoll-fd sap capacity milliseconds)))
    (cond ((plusp count) count)
          ((zerop count) :timeout)
          ((= (sb-alien:get-errno) +eintr+) :interrupted)
          (t (foreign-error "epoll_wait")))))

(declaim (inline reported-token))
(defun reported-token (sap index)
  "The token of the INDEXth event EPOLL-WAIT-INTO wrote at SAP."
  (sb-sys:sap-ref-64 sap (+ (* index +epoll-event-bytes+) +epoll-data-offset+)))

(defun epoll-wait-one (epoll-fd milliseconds)
  "Wait up to MILLISECONDS for one ready descriptor: its token, :TIMEOUT, or
:INTERRUPTED (EPOLL-WAIT-INTO)."
  (sb-alien:with-alien ((event (array (sb-alien:unsigned 8) #.+epoll-event-bytes+)))
    (let* ((sap (sb-alien:alien-sap event))
           (count (epoll-wait-into epoll-fd milliseconds sap 1)))
      (if (integerp count) (reported-token sap 0) count))))

(defun make-wakeup-fd (&key non-blocking)
  "An eventfd(2): once signalled it stays readable, so, watched level-triggered,
it wakes every waiter of an epoll set, now and later; NON-BLOCKING, its read
(CLEAR-TIMER-FD) does not wait."
  (let ((fd (sb-alien:alien-funcall
             (sb-alien:extern-alien "eventfd" (function sb-alien:int sb-alien:unsigned sb-alien:int))
             0 (logior +efd-cloexec+ (if non-blocking +efd-nonblock+ 0)))))
    (when (minusp fd) (foreign-error "eventfd"))
    fd))

(defun signal-wakeup-fd (fd)
  (sb-alien:with-alien ((value (sb-alien:unsigned 64)))
    (setf value 1)
    (sb-unix:unix-write fd (sb-alien:alien-sap (sb-alien:addr value)) 0 8)))

(defun make-timer-fd ()
  "A timerfd(2) on CLOCK_MONOTONIC, not waiting when read, set for nothing."
  (let ((fd (sb-alien:alien-funcall
             (sb-alien:extern-alien "timerfd_create" (function sb-alien:int sb-alien:int sb-alien:int))
             +clock-monotonic+ (logior +tfd-nonblock+ +tfd-cloexec+))))
    (when (minusp fd) (foreign-error "timerfd_create"))
    fd))

(defun set-timer-fd (fd microseconds)
  "Make the timerfd FD readable once CLOCK_MONOTONIC reads MICROSECONDS (as
MONOTONIC-MICROSECONDS counts them), or never when MICROSECONDS is NIL."
  (sb-alien:with-alien ((spec (array (sb-alien:signed 64) 4)))
    (let ((sap (sb-alien:alien-sap spec)))
      ;; it_interval zero: once.  it_value zero disarms, so a time already
      ;; past is set as one nanosecond.
      (setf (sb-sys:signed-sap-ref-64 sap 0) 0
            (sb-sys:signed-sap-ref-64 sap 8) 0
            (sb-sys:signed-sap-ref-64 sap 16) (if microseconds (floor microseconds 1000000) 0)
            (sb-sys:signed-sap-ref-64 sap 24) (if microseconds (max 1 (* 1000 (mod microseconds 1000000))) 0))
      (when (minusp (sb-alien:alien-funcall
                     (sb-alien:extern-alien "timerfd_settime"
                                            (function sb-alien:int sb-alien:int sb-alien:int
                                                      sb-sys:system-area-pointer sb-sys:system-area-pointer))
                     fd +tfd-timer-abstime+ sap (sb-sys:int-sap 0)))
        (foreign-error "timerfd_settime")))))

(defun clear-timer-fd (fd)
  "Read the timerfd or eventfd FD's count, so that it polls readable only
when it expires or is signalled again."
  (sb-alien:with-alien ((count (sb-alien:unsigned 64)))
    (sb-unix:unix-read fd (sb-alien:alien-sap (sb-alien:addr count)) 8)))

(defun close-fd (fd)
  (sb-unix:unix-close fd))

(defun open-spare-fd ()
  "A descriptor on /dev/null, kept to be given up when the process has no
other: its number, or NIL when none could be opened."
  (sb-unix:unix-open "/dev/null" sb-unix:o_rdonly 0))
