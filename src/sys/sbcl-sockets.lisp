;;;; Every use of SBCL's socket and foreign-call internals (sb-alien,
;;;; sb-bsd-sockets, sb-unix, sb-sys) lives in this file, so that the next
;;;; SBCL breaks in one place: Linux epoll(7), eventfd(2), accept4(2),
;;;; recv(2), send(2), shutdown(2), the peer's address, the fd-stream a
;;;; connection is read and written through, and files sent with
;;;; sendfile(2).

(in-package #:hunchentoot-recycling-taskmaster)

#-linux
(error "hunchentoot-recycling-taskmaster needs Linux: its readiness set is epoll(7).")

;;; Linux's constants, in one place.  The errno values SBCL exports are
;;; taken from it; the rest are the same on x86-64 and aarch64 Linux.

(defconstant +epoll-cloexec+ #o2000000)
(defconstant +epoll-ctl-add+ 1)
(defconstant +epoll-ctl-mod+ 3)
(defconstant +epollin+ #x001)
(defconstant +epollout+ #x004)
(defconstant +epollrdhup+ #x2000)
(defconstant +epolloneshot+ (ash 1 30))
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

(defun socket-file-descriptor (usocket)
  (sb-bsd-sockets:socket-file-descriptor (usocket:socket usocket)))

(defun wait-until-readable (usocket milliseconds)
  "True when USOCKET has input (or EOF) within MILLISECONDS.  Uses poll(2),
which, unlike USOCKET:WAIT-FOR-INPUT's select(2), takes descriptors past 1024."
  (wait-until-fd-readable (socket-file-descriptor usocket) milliseconds))

;;; The readiness set: epoll(7), and an eventfd(2) to wake its waiters.

(defun foreign-error (function)
  (error "~A failed: errno ~D" function (sb-alien:get-errno)))

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

(defun epoll-events (awaited one-shot)
  (logior (ecase awaited
            (:input (logior +epollin+ +epollrdhup+))
            (:output +epollout+))
          (if one-shot +epolloneshot+ 0)))

(defun epoll-watch (epoll-fd fd token &key one-shot (awaited :input))
  "Add FD to the set: readable (or hung up) reports TOKEN, or writable when
AWAITED is :OUTPUT.  ONE-SHOT disarms FD once it has been reported to one
waiter, until EPOLL-REARM."
  (epoll-control epoll-fd +epoll-ctl-add+ fd token (epoll-events awaited one-shot)))

(defun epoll-rearm (epoll-fd fd token &key (awaited :input))
  "Arm a one-shot FD again, for input or for output as AWAITED says."
  (epoll-control epoll-fd +epoll-ctl-mod+ fd token (epoll-events awaited t)))

(defun epoll-disarm (epoll-fd fd token)
  "Keep FD in the set but report nothing for it until it is armed again."
  (epoll-control epoll-fd +epoll-ctl-mod+ fd token 0))

(defun epoll-wait-one (epoll-fd milliseconds)
  "Wait up to MILLISECONDS for one ready descriptor: its token, :TIMEOUT, or
:INTERRUPTED (EINTR: SBCL stops every thread with a signal for garbage
collection several times a second, and interrupts arrive the same way)."
  (sb-alien:with-alien ((event (array (sb-alien:unsigned 8) #.+epoll-event-bytes+)))
    (let* ((sap (sb-alien:alien-sap event))
           (count (sb-alien:alien-funcall
                   (sb-alien:extern-alien "epoll_wait" (function sb-alien:int sb-alien:int
                                                                 sb-sys:system-area-pointer
                                                                 sb-alien:int sb-alien:int))
                   epoll-fd sap 1 milliseconds)))
      (cond ((= count 1) (sb-sys:sap-ref-64 sap +epoll-data-offset+))
            ((zerop count) :timeout)
            ((= (sb-alien:get-errno) +eintr+) :interrupted)
            (t (foreign-error "epoll_wait"))))))

(defun make-wakeup-fd ()
  "An eventfd(2): once signalled it stays readable, so, watched level-triggered,
it wakes every waiter of an epoll set, now and later."
  (let ((fd (sb-alien:alien-funcall
             (sb-alien:extern-alien "eventfd" (function sb-alien:int sb-alien:unsigned sb-alien:int))
             0 +efd-cloexec+)))
    (when (minusp fd) (foreign-error "eventfd"))
    fd))

(defun signal-wakeup-fd (fd)
  (sb-alien:with-alien ((value (sb-alien:unsigned 64)))
    (setf value 1)
    (sb-unix:unix-write fd (sb-alien:alien-sap (sb-alien:addr value)) 0 8)))

(defun close-fd (fd)
  (sb-unix:unix-close fd))

(defun open-spare-fd ()
  "A descriptor on /dev/null, kept to be given up when the process has no
other: its number, or NIL when none could be opened."
  (sb-unix:unix-open "/dev/null" sb-unix:o_rdonly 0))

;;; Listening sockets.

(defun socket-option (fd option)
  "The integer value of the SOL_SOCKET option OPTION of FD."
  (sb-alien:with-alien ((value sb-alien:int) (length sb-alien:unsigned))
    (setf length 4)
    (unless (zerop (sb-alien:alien-funcall
                    (sb-alien:extern-alien "getsockopt" (function sb-alien:int sb-alien:int sb-alien:int sb-alien:int
                                                                  (* sb-alien:int) (* sb-alien:unsigned)))
                    fd +sol-socket+ option (sb-alien:addr value) (sb-alien:addr length)))
      (foreign-error "getsockopt"))
    value))

(defun set-integer-socket-option (fd level option value)
  "setsockopt(2) of the integer OPTION at LEVEL of FD to VALUE.  True when it took."
  (sb-alien:with-alien ((option-value sb-alien:int))
    (setf option-value value)
    (zerop (sb-alien:alien-funcall
            (sb-alien:extern-alien "setsockopt" (function sb-alien:int sb-alien:int sb-alien:int sb-alien:int
                                                          (* sb-alien:int) sb-alien:unsigned))
            fd level option (sb-alien:addr option-value) 4))))

(defun send-small-writes-at-once (fd)
  "Set TCP_NODELAY on the connected socket FD.  True when it took."
  (set-integer-socket-option fd +ipproto-tcp+ +tcp-nodelay+ 1))

(defun (setf socket-option) (value fd option)
  (unless (set-integer-socket-option fd +sol-socket+ option value)
    (foreign-error "setsockopt"))
  value)

(defun listen-on (address-vector port backlog &key reuse-port)
  "A usocket listening on ADDRESS-VECTOR (4 octets for IPv4, 16 for IPv6) and
PORT, with SO_REUSEADDR, and SO_REUSEPORT when REUSE-PORT: then every
socket of the machine's processes bound so to the same address and port
takes a share of the connections, which the kernel spreads."
  (let ((socket (make-instance (if (= 16 (length address-vector))
                                   'sb-bsd-sockets:inet6-socket
                                   'sb-bsd-sockets:inet-socket)
                               :type :stream :protocol :tcp)))
    (handler-bind ((error (lambda (condition)
                            (declare (ignore condition))
                            (sb-bsd-sockets:socket-close socket))))
      (usocket:with-mapped-conditions ()
        (setf (sb-bsd-sockets:sockopt-reuse-address socket) t)
        (when reuse-port
          (setf (socket-option (sb-bsd-sockets:socket-file-descriptor socket) +so-reuseport+) 1))
        (sb-bsd-sockets:socket-bind socket address-vector port)
        (sb-bsd-sockets:socket-listen socket backlog)))
    (make-instance 'usocket:stream-server-usocket :socket socket :element-type '(unsigned-byte 8))))

(defun listening-descriptor-p (fd)
  "True when FD is a socket that listens."
  (ignore-errors (= 1 (socket-option fd +so-acceptconn+))))

(defun adopt-listening-descriptor (fd)
  "A usocket for FD, a TCP socket that already listens (inherited from a
supervisor, as with systemd's socket activation)."
  (let* ((ipv6-p (find #\: (socket-address fd :local)))
         (socket (make-instance (if ipv6-p 'sb-bsd-sockets:inet6-socket 'sb-bsd-sockets:inet-socket)
                                :type :stream :protocol :tcp :descriptor fd)))
    ;; SB-BSD-SOCKETS closes a socket's descriptor when the object is
    ;; collected; this one stays the supervisor's, and its number may by
    ;; then belong to another socket.
    (sb-ext:cancel-finalization socket)
    (make-instance 'usocket:stream-server-usocket :socket socket :element-type '(unsigned-byte 8))))

(defun process-id ()
  (sb-unix:unix-getpid))

(defun set-non-blocking (usocket)
  "Make accept(2) on the listening USOCKET return at once when nothing is
pending: a worker woken for it may find the connection already taken by
another.  Accepted sockets do not inherit the flag."
  (setf (sb-bsd-sockets:non-blocking-mode (usocket:socket usocket)) t))

(defun receive-available (fd buffer start end &key peek)
  "recv(2) without waiting into BUFFER from START below END; with PEEK, the
octets stay unread on the socket.  The count read, 0 at end of file,
:WOULD-BLOCK when nothing has arrived, or :ERROR (the peer reset the
connection, or it is otherwise unusable)."
  (declare (type (simple-array (unsigned-byte 8) (*)) buffer) (type fixnum start end))
  (sb-sys:with-pinned-objects (buffer)
    (loop
      (let ((count (sb-alien:alien-funcall
                    (sb-alien:extern-alien "recv" (function sb-alien:long sb-alien:int
                                                            sb-sys:system-area-pointer
                                                            sb-alien:unsigned-long sb-alien:int))
                    fd (sb-sys:sap+ (sb-sys:vector-sap buffer) start) (- end start)
                    (if peek (logior +msg-dontwait+ +msg-peek+) +msg-dontwait+))))
        (cond ((>= count 0) (return count))
              (t (let ((errno (sb-alien:get-errno)))
                   (cond ((= errno +eintr+))
                         ((= errno +eagain+) (return :would-block))
                         (t (return :error))))))))))

(defun send-without-waiting (fd octets)
  "send(2) OCTETS without waiting and without SIGPIPE; what the socket buffer
does not take is dropped.  For short replies on a connection about to close."
  (declare (type (simple-array (unsigned-byte 8) (*)) octets))
  (sb-sys:with-pinned-objects (octets)
    (sb-alien:alien-funcall
     (sb-alien:extern-alien "send" (function sb-alien:long sb-alien:int sb-sys:system-area-pointer
                                             sb-alien:unsigned-long sb-alien:int))
     fd (sb-sys:vector-sap octets) (length octets) (logior +msg-dontwait+ +msg-nosignal+))))

(defun send-octets (fd octets start end &key more)
  "send(2) the OCTETS from START below END to the non-blocking socket FD,
without SIGPIPE; with MORE, as MSG_MORE: more follows at once, so that a
partial segment is held back for it.  The count sent, :WOULD-BLOCK when
the socket buffer is full, or :ERROR (the client has gone)."
  (declare (type (simple-array (unsigned-byte 8) (*)) octets) (type fixnum start end))
  (sb-sys:with-pinned-objects (octets)
    (loop
      (let ((count (sb-alien:alien-funcall
                    (sb-alien:extern-alien "send" (function sb-alien:long sb-alien:int sb-sys:system-area-pointer
                                                            sb-alien:unsigned-long sb-alien:int))
                    fd (sb-sys:sap+ (sb-sys:vector-sap octets) start) (- end start)
                    (logior +msg-dontwait+ +msg-nosignal+ (if more +msg-more+ 0)))))
        (cond ((>= count 0) (return count))
              (t (let ((errno (sb-alien:get-errno)))
                   (cond ((= errno +eintr+))
                         ((= errno +eagain+) (return :would-block))
                         (t (return :error))))))))))

(defconstant +siocoutq+ #x5411)

(defun unacknowledged-octets (fd)
  "The octets written to the TCP socket FD that its peer has not
acknowledged yet (ioctl SIOCOUTQ), or NIL when they cannot be told."
  (sb-alien:with-alien ((count sb-alien:int))
    (and (zerop (sb-alien:alien-funcall
                 (sb-alien:extern-alien "ioctl" (function sb-alien:int sb-alien:int sb-alien:unsigned-long
                                                          (* sb-alien:int)))
                 fd +siocoutq+ (sb-alien:addr count)))
         count)))

(defun fd-writable-p (fd)
  "True when FD's socket has room for more output now."
  (sb-unix:unix-simple-poll fd :output 0))

(defun wait-until-fd-readable (fd milliseconds)
  "True when FD has input (or EOF) within MILLISECONDS."
  (sb-unix:unix-simple-poll fd :input milliseconds))

;;; Connections.

(defun end-of-file-p (fd)
  "True when FD's peer has closed the connection and no byte remains unread."
  (sb-alien:with-alien ((octet (sb-alien:unsigned 8)))
    (zerop (sb-alien:alien-funcall
            (sb-alien:extern-alien "recv" (function sb-alien:long sb-alien:int sb-sys:system-area-pointer
                                                    sb-alien:unsigned-long sb-alien:int))
            fd (sb-alien:alien-sap (sb-alien:addr octet)) 1 (logior +msg-peek+ +msg-dontwait+)))))

(defun accept-connection-fd (listen-fd)
  "accept4(2) on the non-blocking LISTEN-FD: the new connection's descriptor,
or NIL when none is pending or it was aborted before it was taken.  Other
failures (EMFILE, ...) signal an error.  The connection is non-blocking,
so that sendfile(2) gives up when the socket is full; SBCL's fd-streams
and OpenSSL's reads wait on it by poll(2) instead, within their timeouts."
  (loop
    (let ((fd (sb-alien:alien-funcall
               (sb-alien:extern-alien "accept4" (function sb-alien:int sb-alien:int sb-alien:unsigned-long
                                                          sb-alien:unsigned-long sb-alien:int))
               listen-fd 0 0 (logior +sock-cloexec+ +sock-nonblock+))))
      (if (>= fd 0)
          (return fd)
          (let ((errno (sb-alien:get-errno)))
            (cond ((= errno +eintr+))
                  ((member errno (list +eagain+ +econnaborted+)) (return nil))
                  (t (foreign-error "accept4"))))))))

(defconstant +af-inet+ 2)
(defconstant +af-inet6+ 10)
(defconstant +sockaddr-storage-bytes+ 128)
(defconstant +inet6-addrstrlen+ 46)

(defun socket-address (fd side)
  "The address, as text, and the port of one end of the connection FD: SIDE
is :PEER (getpeername) or :LOCAL (getsockname).  IPv4 in dotted quads, IPv6
in inet_ntop(3)'s RFC 5952 form (::1)."
  (sb-alien:with-alien ((address (array (sb-alien:unsigned 8) #.+sockaddr-storage-bytes+))
                        (length sb-alien:unsigned)
                        (text (array sb-alien:char #.+inet6-addrstrlen+)))
    (setf length +sockaddr-storage-bytes+)
    (let ((sap (sb-alien:alien-sap address)))
      (unless (zerop (ecase side
                       (:peer (sb-alien:alien-funcall
                               (sb-alien:extern-alien "getpeername" (function sb-alien:int sb-alien:int
                                                                              sb-sys:system-area-pointer
                                                                              (* sb-alien:unsigned)))
                               fd sap (sb-alien:addr length)))
                       (:local (sb-alien:alien-funcall
                                (sb-alien:extern-alien "getsockname" (function sb-alien:int sb-alien:int
                                                                               sb-sys:system-area-pointer
                                                                               (* sb-alien:unsigned)))
                                fd sap (sb-alien:addr length)))))
        (foreign-error (if (eq side :peer) "getpeername" "getsockname")))
      ;; sockaddr_in and sockaddr_in6 alike: family (2 octets, host order),
      ;; port (network order); the address at 4 (IPv4) or 8 (IPv6).
      (let ((family (sb-sys:sap-ref-16 sap 0))
            (port (+ (* 256 (sb-sys:sap-ref-8 sap 2)) (sb-sys:sap-ref-8 sap 3))))
        (unless (member family (list +af-inet+ +af-inet6+))
          (error "The ~(~A~) address of descriptor ~D is of family ~D, neither IPv4 nor IPv6."
                 side fd family))
        (when (sb-alien:null-alien
               (sb-alien:alien-funcall
                (sb-alien:extern-alien "inet_ntop" (function (* sb-alien:char) sb-alien:int
                                                             sb-sys:system-area-pointer
                                                             (* sb-alien:char) sb-alien:unsigned))
                family (sb-sys:sap+ sap (if (= family +af-inet+) 4 8))
                (sb-alien:cast text (* sb-alien:char)) +inet6-addrstrlen+))
          (foreign-error "inet_ntop"))
        (values (let ((text-sap (sb-alien:alien-sap text)))
                  (coerce (loop for index from 0
                                for octet = (sb-sys:sap-ref-8 text-sap index)
                                until (zerop octet)
                                collect (code-char octet))
                          'string))
                port)))))

(defun connection-addresses-of (fd)
  "The peer's address and port, then ours, of the connection FD, as
Hunchentoot's request holds them."
  (multiple-value-call #'list (socket-address fd :peer) (socket-address fd :local)))

(defun make-connection-fd-stream (fd timeout)
  "A binary bidirectional stream on the connection FD whose reads and writes
give up after TIMEOUT seconds (NIL: never), as Hunchentoot sets them.  No
finalizer: the readiness set closes every connection itself."
  (sb-sys:make-fd-stream fd :input t :output t :element-type '(unsigned-byte 8)
                            :buffering :full :timeout timeout :auto-close nil
                            :name "hunchentoot-recycling-taskmaster connection"))

(defun fd-stream-class ()
  "The class of the streams MAKE-CONNECTION-FD-STREAM makes."
  (find-class 'sb-sys:fd-stream))

(defun shut-down-fd-output (fd)
  "Send FIN on the connection FD while its input stays readable."
  (sb-alien:alien-funcall (sb-alien:extern-alien "shutdown" (function sb-alien:int sb-alien:int sb-alien:int))
                          fd +shut-wr+))

(defun shut-down-fd (fd)
  "Shut the connection FD down both ways without closing it: a thread
blocked reading or writing it (in Lisp or inside OpenSSL) returns at once
with end of file or an error and unwinds by itself.  The descriptor stays
its holder's to close, so it cannot be reused meanwhile."
  (sb-alien:alien-funcall (sb-alien:extern-alien "shutdown" (function sb-alien:int sb-alien:int sb-alien:int))
                          fd +shut-rdwr+))

;;; Files sent with sendfile(2).

(defconstant +s-ifmt+ #o170000)
(defconstant +s-ifreg+ #o100000)
(defconstant +s-ifdir+ #o040000)

(defun open-regular-file (namestring)
  "A descriptor open for reading on the regular file NAMESTRING, its size in
octets and its modification time (a universal time); NIL when it cannot be
opened or is not a regular file.  Opened and looked at once: what is sent
is what was looked at, whatever happens to the name meanwhile."
  (let ((fd (sb-unix:unix-open namestring (logior sb-unix:o_rdonly +sock-cloexec+) 0)))
    (when fd
      (multiple-value-bind (ok device inode mode links uid gid rdev size atime mtime)
          (sb-unix:unix-fstat fd)
        (declare (ignore device inode links uid gid rdev atime))
        (if (and ok (= (logand mode +s-ifmt+) +s-ifreg+))
            (values fd size (+ mtime #.(encode-universal-time 0 0 0 1 1 1970 0)))
            (progn (sb-unix:unix-close fd) nil))))))

(defun directory-path-p (namestring)
  "True when NAMESTRING names a directory."
  (multiple-value-bind (ok device inode mode) (sb-unix:unix-stat namestring)
    (declare (ignore device inode))
    (and ok (= (logand mode +s-ifmt+) +s-ifdir+))))

(defun stream-file-descriptor (stream)
  "The descriptor STREAM writes to when it is SBCL's plain fd-stream, else NIL."
  (and (typep stream 'sb-sys:fd-stream)
       (sb-sys:fd-stream-fd stream)))

(defun send-file-octets (socket-fd file-fd start end)
  "Send the octets of FILE-FD from START below END to the non-blocking
socket SOCKET-FD with sendfile(2), in the kernel, as many as the socket
takes now: their count, 0 when the file ends before START (it was
truncated), :WOULD-BLOCK when the socket buffer is full, or :ERROR."
  (sb-alien:with-alien ((offset (sb-alien:signed 64)))
    (setf offset start)
    (loop
      (let ((sent (sb-alien:alien-funcall
                   (sb-alien:extern-alien "sendfile" (function sb-alien:long sb-alien:int sb-alien:int
                                                               (* (sb-alien:signed 64)) sb-alien:unsigned-long))
                   socket-fd file-fd (sb-alien:addr offset) (min (- end start) (ash 1 30)))))
        (cond ((>= sent 0) (return sent))
              (t (let ((errno (sb-alien:get-errno)))
                   (cond ((= errno +eintr+))
                         ((= errno +eagain+) (return :would-block))
                         (t (return :error))))))))))

(defun duplicate-fd (fd)
  "A new descriptor on what FD is open on (dup(2)), or NIL."
  (sb-unix:unix-dup fd))

(defun read-file-octets (fd buffer position)
  "Read from FD at POSITION into BUFFER (octets) with pread(2), without
moving FD's offset: the count read, 0 at the file's end, NIL on error."
  (sb-sys:with-pinned-objects (buffer)
    (let ((count (sb-alien:alien-funcall
                  (sb-alien:extern-alien "pread" (function sb-alien:long sb-alien:int sb-sys:system-area-pointer
                                                           sb-alien:unsigned-long (sb-alien:signed 64)))
                  fd (sb-sys:vector-sap buffer) (length buffer) position)))
      (and (>= count 0) count))))

(defun native-path (pathname)
  "PATHNAME as the operating system spells it, with no Lisp wildcard syntax."
  (sb-ext:native-namestring pathname))

(defun real-path (namestring)
  "NAMESTRING with every symbolic link, . and .. resolved (realpath(3)), or
NIL when it names nothing."
  (sb-alien:with-alien ((resolved (array sb-alien:char 4096)))
    (let ((result (sb-alien:alien-funcall
                   (sb-alien:extern-alien "realpath" (function sb-sys:system-area-pointer sb-alien:c-string
                                                               (* sb-alien:char)))
                   namestring (sb-alien:cast resolved (* sb-alien:char)))))
      (unless (zerop (sb-sys:sap-int result))
        (sb-alien:cast resolved sb-alien:c-string)))))
