;;;; Sockets through SBCL's internals (sb-alien, sb-bsd-sockets, sb-unix,
;;;; sb-sys): listening, accept4(2), recv(2) and send(2) without waiting,
;;;; shutdown(2) and the addresses of a connection (the fd-stream it is
;;;; read and written through: sbcl-fd-streams.lisp).  With sbcl-epoll.lisp
;;;; and sbcl-files.lisp, every foreign call the library makes; Linux's
;;;; numbers are linux.lisp's.

(in-package #:hunchentoot-recycling-taskmaster)

(defun socket-file-descriptor (usocket)
  (sb-bsd-sockets:socket-file-descriptor (usocket:socket usocket)))

;;; Listening sockets.

(defun socket-option (fd option &optional (level +sol-socket+))
  "The integer value of the option OPTION at LEVEL (SOL_SOCKET unless
given) of FD."
  (sb-alien:with-alien ((value sb-alien:int) (length sb-alien:unsigned))
    (setf length 4)
    (unless (zerop (sb-alien:alien-funcall
                    (sb-alien:extern-alien "getsockopt" (function sb-alien:int sb-alien:int sb-alien:int sb-alien:int
                                                                  (* sb-alien:int) (* sb-alien:unsigned)))
                    fd level option (sb-alien:addr value) (sb-alien:addr length)))
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
  "Set TCP_NODELAY on the socket FD: a connected one, or a listening one,
whose connections inherit it (Linux).  True when it took."
  (set-integer-socket-option fd +ipproto-tcp+ +tcp-nodelay+ 1))

(defun defer-accepting-until-data (fd seconds)
  "Set TCP_DEFER_ACCEPT on the listening socket FD: the kernel hands over a
connection only once its client has sent something, or, for a client that
sends nothing, once about SECONDS have passed.  True when it took."
  (set-integer-socket-option fd +ipproto-tcp+ +tcp-defer-accept+ seconds))

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

;;; Connections.

(defun receive-available (fd buffer start end &key peek)
  "recv(2) without waiting into BUFFER from START below END; with PEEK, the
octets stay unread on the socket.  The count read, 0 at end of file,
:WOULD-BLOCK when nothing has arrived, or :ERROR (the peer reset the
connection, or it is otherwise unusable)."
  (declare (type (simple-array (unsigned-byte 8) (*)) buffer) (type fixnum start end))
  (sb-sys:with-pinned-objects (buffer)
    (without-blocking
      (sb-alien:alien-funcall
       (sb-alien:extern-alien "recv" (function sb-alien:long sb-alien:int sb-sys:system-area-pointer
                                               sb-alien:unsigned-long sb-alien:int))
       fd (sb-sys:sap+ (sb-sys:vector-sap buffer) start) (- end start)
       (if peek (logior +msg-dontwait+ +msg-peek+) +msg-dontwait+)))))

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
    (without-blocking
      (sb-alien:alien-funcall
       (sb-alien:extern-alien "send" (function sb-alien:long sb-alien:int sb-sys:system-area-pointer
                                               sb-alien:unsigned-long sb-alien:int))
       fd (sb-sys:sap+ (sb-sys:vector-sap octets) start) (- end start)
       (logior +msg-dontwait+ +msg-nosignal+ (if more +msg-more+ 0))))))

(defun unacknowledged-octets (fd)
  "The octets written to the TCP socket FD that its peer has not
acknowledged yet (ioctl SIOCOUTQ), or NIL when they cannot be told."
  (sb-alien:with-alien ((count sb-alien:int))
    (and (zerop (sb-alien:alien-funcall
                 (sb-alien:extern-alien "ioctl" (function sb-alien:int sb-alien:int sb-alien:unsigned-long
                                                          (* sb-alien:int)))
                 fd +siocoutq+ (sb-alien:addr count)))
         count)))

(defun tcp-connection-closed-p (fd)
  "True when the TCP connection of the socket FD has closed for good (its
peer reset it), not only been half-closed by its peer; true too when FD
cannot be asked."
  (let ((info (ignore-errors (socket-option fd +tcp-info+ +ipproto-tcp+))))
    (or (null info) (= (ldb (byte 8 0) info) +tcp-state-close+))))

(defun fd-writable-p (fd)
  "True when FD's socket has room for more output now."
  (sb-unix:unix-simple-poll fd :output 0))

(defun wait-until-fd-readable (fd milliseconds)
  "True when FD has input (or EOF) within MILLISECONDS."
  (sb-unix:unix-simple-poll fd :input milliseconds))

(defun end-of-file-p (fd)
  "True when FD's peer has closed the connection and no byte remains unread."
  (sb-alien:with-alien ((octet (sb-alien:unsigned 8)))
    (zerop (sb-alien:alien-funcall
            (sb-alien:extern-alien "recv" (function sb-alien:long sb-alien:int sb-sys:system-area-pointer
                                                    sb-alien:unsigned-long sb-alien:int))
            fd (sb-alien:alien-sap (sb-alien:addr octet)) 1 (logior +msg-peek+ +msg-dontwait+)))))

(defun dotted-quad (a b c d)
  "The IPv4 address of the octets A, B, C and D in dotted quads, as
inet_ntop(3) writes it."
  ;; glibc's inet_ntop formats it with sprintf: 1% of the user time of a
  ;; connection that carries one request.
  (declare (type (unsigned-byte 8) a b c d))
  (flet ((digit-count (octet) (cond ((< octet 10) 1) ((< octet 100) 2) (t 3))))
    (let ((string (make-string (+ 3 (digit-count a) (digit-count b) (digit-count c) (digit-count d))))
          (position 0))
      (declare (type fixnum position))
      (labels ((put-digit (digit)
                 (declare (type (integer 0 9) digit))
                 (setf (char string position) (code-char (+ 48 digit)))
                 (incf position))
               (put (octet)
                 (declare (type (unsigned-byte 8) octet))
                 (when (>= octet 100) (put-digit (floor octet 100)))
                 (when (>= octet 10) (put-digit (mod (floor octet 10) 10)))
                 (put-digit (mod octet 10))))
        (put a)
        (flet ((put-after-dot (octet)
                 (setf (char string position) #\.)
                 (incf position)
                 (put octet)))
          (put-after-dot b)
          (put-after-dot c)
          (put-after-dot d)))
      string)))

(defun sockaddr-address (sap)
  "The address, as text, and the port of the sockaddr at SAP: IPv4 in
dotted quads, IPv6 in inet_ntop(3)'s RFC 5952 form (::1); NIL for another
family."
  ;; sockaddr_in and sockaddr_in6 alike: family (2 octets, host order),
  ;; port (network order); the address at 4 (IPv4) or 8 (IPv6).
  (let ((family (sb-sys:sap-ref-16 sap 0))
        (port (+ (* 256 (sb-sys:sap-ref-8 sap 2)) (sb-sys:sap-ref-8 sap 3))))
    (cond ((= family +af-inet+)
           (values (dotted-quad (sb-sys:sap-ref-8 sap 4) (sb-sys:sap-ref-8 sap 5)
                                (sb-sys:sap-ref-8 sap 6) (sb-sys:sap-ref-8 sap 7))
                   port))
          ((= family +af-inet6+)
           (sb-alien:with-alien ((text (array sb-alien:char #.+inet6-addrstrlen+)))
             (when (sb-alien:null-alien
                    (sb-alien:alien-funcall
                     (sb-alien:extern-alien "inet_ntop" (function (* sb-alien:char) sb-alien:int
                                                                  sb-sys:system-area-pointer
                                                                  (* sb-alien:char) sb-alien:unsigned))
                     family (sb-sys:sap+ sap 8) (sb-alien:cast text (* sb-alien:char)) +inet6-addrstrlen+))
               (foreign-error "inet_ntop"))
             (let* ((text-sap (sb-alien:alien-sap text))
                    (string (make-string (loop for index from 0
                                               until (zerop (sb-sys:sap-ref-8 text-sap index))
                                               finally (return index)))))
               (dotimes (index (length string))
                 (setf (char string index) (code-char (sb-sys:sap-ref-8 text-sap index))))
               (values string port)))))))

(defun accept-connection-fd (listen-fd)
  "accept4(2) on the non-blocking LISTEN-FD: the new connection's
descriptor, then its peer's address, as text, and port (SOCKADDR-ADDRESS:
no getpeername(2) needed); or NIL when none is pending or it was aborted
before it was taken.  Other failures (EMFILE, ...) signal an error.  The
connection is non-blocking, so that sendfile(2) gives up when the socket is
full; SBCL's fd-streams and OpenSSL's reads wait on it by poll(2) instead,
within their timeouts."
  (sb-alien:with-alien ((address (array (sb-alien:unsigned 8) #.+sockaddr-storage-bytes+))
                        (length sb-alien:unsigned))
    (loop
      (setf length +sockaddr-storage-bytes+)
      (let ((fd (sb-alien:alien-funcall
                 (sb-alien:extern-alien "accept4" (function sb-alien:int sb-alien:int sb-sys:system-area-pointer
                                                            (* sb-alien:unsigned) sb-alien:int))
                 listen-fd (sb-alien:alien-sap address) (sb-alien:addr length)
                 (logior +sock-cloexec+ +sock-nonblock+))))
        (if (>= fd 0)
            (return (multiple-value-call #'values fd (sockaddr-address (sb-alien:alien-sap address))))
            (let ((errno (sb-alien:get-errno)))
              (cond ((= errno +eintr+))
                    ((member errno (list +eagain+ +econnaborted+)) (return nil))
                    (t (foreign-error "accept4")))))))))

(defun socket-address (fd side)
  "The address, as text, and the port of one end of the connection FD: SIDE
is :PEER (getpeername) or :LOCAL (getsockname).  See SOCKADDR-ADDRESS."
  (sb-alien:with-alien ((address (array (sb-alien:unsigned 8) #.+sockaddr-storage-bytes+))
                        (length sb-alien:unsigned))
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
      (multiple-value-bind (text port) (sockaddr-address sap)
        (unless text
          (error "The ~(~A~) address of descriptor ~D is of family ~D, neither IPv4 nor IPv6."
                 side fd (sb-sys:sap-ref-16 sap 0)))
        (values text port)))))

(defun wildcard-address-p (text)
  "True when TEXT (SOCKADDR-ADDRESS) is the IPv4 or IPv6 address that stands
for every address of the host."
  (member text '("0.0.0.0" "::") :test #'string=))

(defun connection-addresses-of (fd)
  "The peer's address and port, then ours, of the connection FD, as
Hunchentoot's request holds them."
  (multiple-value-call #'list (socket-address fd :peer) (socket-address fd :local)))

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
