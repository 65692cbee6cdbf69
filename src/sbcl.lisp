;;;; Every use of SBCL internals (sb-alien, sb-bsd-sockets, sb-sys,
;;;; sb-unix) lives in this file, so that the next SBCL breaks in one place.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +sol-socket+ 1)
(defconstant +so-rcvtimeo+ 20)

(defun socket-file-descriptor (usocket)
  (sb-bsd-sockets:socket-file-descriptor (usocket:socket usocket)))

(defun set-accept-timeout (listen-socket seconds)
  "Make accept(2) on LISTEN-SOCKET (a usocket) give up after SECONDS, so that
a worker blocked in it wakes to look at the pool.  Linux applies SO_RCVTIMEO
to accept(2); USOCKET:SOCKET-ACCEPT then returns NIL."
  (multiple-value-bind (whole-seconds fraction) (floor seconds)
    (sb-alien:with-alien ((timeval (array sb-alien:long 2)))
      (setf (sb-alien:deref timeval 0) whole-seconds
            (sb-alien:deref timeval 1) (floor (* fraction 1000000)))
      (let ((result (sb-alien:alien-funcall
                     (sb-alien:extern-alien "setsockopt"
                                            (function sb-alien:int sb-alien:int sb-alien:int
                                                      sb-alien:int (* t) sb-alien:unsigned))
                     (socket-file-descriptor listen-socket)
                     +sol-socket+ +so-rcvtimeo+ (sb-alien:alien-sap timeval)
                     (* 2 (sb-alien:alien-size sb-alien:long :bytes)))))
        (unless (zerop result)
          (error "setsockopt(SO_RCVTIMEO) failed: errno ~D" (sb-alien:get-errno)))))))

(defun wake-accepting-threads (listen-socket)
  "Make every accept(2) blocked on LISTEN-SOCKET, and every later one, fail
at once.  On Linux shutdown(2) of a listening socket does that; close(2)
would leave the blocked threads sleeping."
  (ignore-errors
   (sb-bsd-sockets:socket-shutdown (usocket:socket listen-socket) :direction :input)))

(defun shut-down-output (usocket)
  "Send FIN on USOCKET while its input stays readable."
  (ignore-errors
   (sb-bsd-sockets:socket-shutdown (usocket:socket usocket) :direction :output)))

(defun wait-until-readable (usocket milliseconds)
  "True when USOCKET has input (or EOF) within MILLISECONDS.  Uses poll(2),
which, unlike USOCKET:WAIT-FOR-INPUT's select(2), takes descriptors past 1024."
  (sb-unix:unix-simple-poll (socket-file-descriptor usocket) :input milliseconds))

(defmacro without-interrupts (&body body)
  "Run BODY with BT:INTERRUPT-THREAD deferred, so that an interrupt cannot
leave a pool state change half done."
  `(sb-sys:without-interrupts ,@body))

(defun condition-broadcast (condition-variable)
  "Wake every thread waiting on CONDITION-VARIABLE; bordeaux-threads 0.8.8
can only wake one."
  (sb-thread:condition-broadcast condition-variable))

(defun join-thread-within (thread seconds)
  "Join THREAD, giving up after SECONDS.  True when it ended."
  (multiple-value-bind (result problem)
      (sb-thread:join-thread thread :default nil :timeout seconds)
    (declare (ignore result))
    (not (eq problem :timeout))))

(defmacro memory-barrier ()
  "Order this thread's earlier writes before its later reads, which x86-64
does not do by itself."
  `(sb-thread:barrier (:memory)))
