;;;; Linux's numbers, in one place, and how a system call's failure is read.
;;;; The errno values SBCL exports are taken from it; the rest are the same
;;;; on x86-64 and aarch64 Linux.

(in-package #:hunchentoot-recycling-taskmaster)

#-linux
(error "hunchentoot-recycling-taskmaster needs Linux: its readiness set is epoll(7).")

(defconstant +epoll-cloexec+ #o2000000)

(defconstant +epoll-ctl-add+ 1)

(defconstant +epoll-ctl-del+ 2)

(defconstant +epoll-ctl-mod+ 3)

(defconstant +epollin+ #x001)

(defconstant +epollout+ #x004)

(defconstant +epollrdhup+ #x2000)

(defconstant +epolloneshot+ (ash 1 30))

(defconstant +epollet+ (ash 1 31))

(defconstant +epoll-event-bytes+ #+x86-64 12 #-x86-64 16
  "The size of struct epoll_event: packed on x86-64 only (glibc's
__EPOLL_PACKED), naturally aligned elsewhere.")

(defconstant +epoll-data-offset+ #+x86-64 4 #-x86-64 8
  "Where the 64-bit data member of struct epoll_event starts, after the
32-bit events member.")

(defconstant +eintr+ sb-unix:eintr)

(defconstant +eagain+ sb-unix:eagain)

(defconstant +econnaborted+ 103)

(defconstant +msg-peek+ 2)

(defconstant +msg-dontwait+ #x40)

(defconstant +msg-nosignal+ #x4000)

(defconstant +efd-cloexec+ #o2000000)

(defconstant +efd-nonblock+ #o4000)

(defconstant +sock-cloexec+ #o2000000)

(defconstant +sock-nonblock+ #o4000)

(defconstant +msg-more+ #x8000)

(defconstant +shut-wr+ 1)

(defconstant +shut-rdwr+ 2)

(defconstant +sol-socket+ 1)

(defconstant +so-reuseport+ 15)

(defconstant +so-acceptconn+ 30)

(defconstant +ipproto-tcp+ 6)

(defconstant +tcp-nodelay+ 1)
;; struct tcp_info begins with the connection's state, an octet; TCP_CLOSE
;; is the state of one its peer reset.
(defconstant +tcp-info+ 11)
(defconstant +tcp-state-close+ 7)

(defconstant +tcp-defer-accept+ 9)

(defconstant +siocoutq+ #x5411)

(defconstant +af-inet+ 2)

(defconstant +af-inet6+ 10)

(defconstant +sockaddr-storage-bytes+ 128)

(defconstant +inet6-addrstrlen+ 46)

(defconstant +s-ifmt+ #o170000)

(defconstant +s-ifreg+ #o100000)

(defconstant +s-ifdir+ #o040000)

(defconstant +clock-monotonic+ 1)

(defconstant +tfd-nonblock+ #o4000)

(defconstant +tfd-cloexec+ #o2000000)

(defconstant +tfd-timer-abstime+ 1)

(defconstant +sched-other+ 0
  "sched(7)'s default time-sharing policy.")

(defconstant +sched-batch+ 3
  "sched(7)'s time-sharing policy for threads whose wake-up should not
preempt the thread running.")

(defconstant +unix-epoch-universal-time+ 2208988800
  "The universal time of 1970-01-01 00:00 UTC, from which the kernel's times
count their seconds.")

(defconstant +sc-nprocessors-onln+ 84
  "sysconf(3)'s name for the number of processors online (glibc).")

(defun foreign-error (function)
  (error "~A failed: errno ~D" function (sb-alien:get-errno)))

(defmacro without-blocking (call)
  "CALL, a system call on a non-blocking descriptor that returns a count or
-1, made again while a signal interrupts it (EINTR: SBCL stops every
thread with a signal for garbage collection): the count; :WOULD-BLOCK when
the call would wait (EAGAIN); :ERROR for any other failure."
  (let ((result (gensym "RESULT")))
    `(loop
       (let ((,result ,call))
         (if (>= ,result 0)
             (return ,result)
             (let ((errno (sb-alien:get-errno)))
               (cond ((= errno +eintr+))
                     ((= errno +eagain+) (return :would-block))
                     (t (return :error)))))))))
