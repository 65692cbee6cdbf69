;;;; Clients that hold a connection by being slow, against one server:
;;;; bench/run slow-readers runs RUN-SLOW-READERS-LOAD, bench/run slow-bodies
;;;; RUN-SLOW-BODIES-LOAD, bench/run tls-handshakes RUN-TLS-HANDSHAKES-LOAD.
;;;;
;;;; :SLOW-READERS  CONNECTIONS clients, each asking GET /megabytes?n=MEGABYTES
;;;;                (1 MiB by default) once and reading 1 KiB a second for
;;;;                SECONDS, then the rest as fast as it comes: every reply
;;;;                must arrive whole.  On loopback the kernel's socket
;;;;                buffers take up to 4 MiB of a reply at once; larger ones
;;;;                leave the rest with the server, parked.
;;;;
;;;; :SLOW-BODIES   CONNECTIONS clients, each POSTing KILOBYTES KiB (100 by
;;;;                default) to /body-length at 1 KiB a second for SECONDS,
;;;;                then the rest as fast as the server takes it: every reply
;;;;                must echo the body's length.  With CHUNKED, the bodies are
;;;;                sent chunked, 1 KiB a chunk.
;;;;
;;;; :TLS-HANDSHAKES  CONNECTIONS connections to an SSL acceptor that send
;;;;                nothing and as many that send half a ClientHello, for
;;;;                SECONDS, each one the server closes replaced at once:
;;;;                every one must be closed at the header timeout.
;;;;
;;;; Meanwhile the separate client of bench/connections.lisp opens a
;;;; connection for one GET /yo every 20 ms.  Each slow client sets its
;;;; receive buffer to 8 KiB (16 KiB as the kernel counts it) before it
;;;; connects, so that its TCP window reopens as it reads, as over a
;;;; network: on loopback, whose segments are 64 KiB, a larger buffer
;;;; reopens only once 64 KiB are free, a minute at 1 KiB/s, and no server
;;;; could tell such a client from one that reads nothing (see README,
;;;; Limits).

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defconstant +slow-read-octets+ 1024
  "What a slow reader reads each second.")

(defconstant +slow-reader-receive-buffer+ 8192)

(defconstant +so-rcvbuf+ 8)

(defconstant +sol-socket+ 1)

(defstruct (slow-reader (:conc-name reader-))
  (socket nil)
  (fd -1 :type fixnum)
  ;; :HEAD until the reply's head is in, then :BODY, then :DONE; :CLOSED
  ;; when the server ended the connection first.
  (state :head :type keyword)
  (due 0 :type fixnum)
  (head (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t))
  (status nil)
  (body-length 0 :type fixnum)
  (body-received 0 :type fixnum))

(defun open-slow-reader (port epoll-fd index path)
  "A slow reader that has asked PATH, watched in EPOLL-FD as INDEX; NIL when
it could not connect."
  (handler-case
      (let* ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp))
             (fd (sb-bsd-sockets:socket-file-descriptor socket)))
        ;; Before connecting, so that the window the client first offers is
        ;; already that small.
        (hrt::set-integer-socket-option fd +sol-socket+ +so-rcvbuf+ +slow-reader-receive-buffer+)
        (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port)
        (hrt::send-without-waiting fd (octets-of (format nil "GET ~A HTTP/1.1~C~CHost: 127.0.0.1~C~C~C~C" path
                                                         #\Return #\Linefeed #\Return #\Linefeed
                                                         #\Return #\Linefeed)))
        (hrt::epoll-watch epoll-fd fd index)
        (make-slow-reader :socket socket :fd fd :due (seconds-from-now (random 1.0))))
    (error () nil)))

(defun note-reply-head (reader)
  "READER's reply head is in: note its status and Content-Length."
  (let* ((head (reader-head reader))
         (match (nth-value 1 (cl-ppcre:scan-to-strings "(?i)content-length:\\s*(\\d+)"
                                                       (map 'string #'code-char head)))))
    (setf (reader-status reader) (reply-status head)
          (reader-body-length reader) (if match (parse-integer (aref match 0)) 0)
          (reader-state reader) :body)))

(defun take-reply-octets (reader buffer count)
  "Account for COUNT octets of READER's reply read into BUFFER."
  (let ((start 0))
    (loop while (and (< start count) (eq (reader-state reader) :head))
          do (let ((head (reader-head reader)))
               (vector-push-extend (aref buffer start) head)
               (incf start)
               (when (and (>= (length head) 4) (equalp (subseq head (- (length head) 4)) #(13 10 13 10)))
                 (note-reply-head reader))))
    (incf (reader-body-received reader) (- count start))
    (when (and (eq (reader-state reader) :body)
               (>= (reader-body-received reader) (reader-body-length reader)))
      (setf (reader-state reader) :done))))

(defun read-some (reader buffer limit)
  "Read up to LIMIT octets of READER's reply; false once the server closed."
  (let ((count (hrt::receive-available (reader-fd reader) buffer 0 limit)))
    (cond ((eq count :would-block) t)
          ((or (eq count :error) (eql count 0))
           (unless (eq (reader-state reader) :done)
             (setf (reader-state reader) :closed))
           nil)
          (t (take-reply-octets reader buffer count) t))))

(defun unfinished-p (reader)
  (and reader (member (reader-state reader) '(:head :body))))

(defun run-slow-readers (port connection-count seconds megabytes)
  "Open CONNECTION-COUNT slow readers (up to 100 a tick) asking MEGABYTES
MiB each, read each 1 KiB a second for SECONDS, then everything as it
comes, for 120 s at most.  Returns the readers."
  (let ((epoll-fd (hrt::make-epoll-set))
        (readers (make-array connection-count :initial-element nil))
        (buffer (make-array 65536 :element-type '(unsigned-byte 8))))
    (unwind-protect
         (progn
           (loop for index below connection-count
                 do (setf (aref readers index)
                          (open-slow-reader port epoll-fd index (format nil "/megabytes?n=~D" megabytes)))
                    (when (zerop (mod (1+ index) 100)) (sleep 0.01)))
           (loop with end = (seconds-from-now seconds)
                 until (>= (now) end)
                 do (loop for reader across readers
                          when (and (unfinished-p reader) (<= (reader-due reader) (now)))
                            do (read-some reader buffer +slow-read-octets+)
                               (setf (reader-due reader) (seconds-from-now 1)))
                    (sleep 0.01))
           (loop with end = (seconds-from-now 120)
                 while (and (< (now) end) (some #'unfinished-p readers))
                 do (let ((token (hrt::epoll-wait-one epoll-fd 100)))
                      (when (integerp token)
                        (let ((reader (aref readers token)))
                          (when (unfinished-p reader)
                            (loop while (and (read-some reader buffer (length buffer))
                                             (unfinished-p reader)
                                             (hrt::wait-until-fd-readable (reader-fd reader) 0)))))))))
      (loop for reader across readers
            when reader do (ignore-errors (sb-bsd-sockets:socket-close (reader-socket reader))))
      (hrt::close-fd epoll-fd))
    readers))

(defun sample-pool-peaks (port key stop-flag)
  "The most KEY (a key of TASKMASTER-STATISTICS) and busy threads the server
reported, read every second until (CAR STOP-FLAG) is true."
  (loop with most-of-key = 0
        with most-busy = 0
        until (car stop-flag)
        do (let ((statistics (server-pool-statistics port)))
             (when statistics
               (setf most-of-key (max most-of-key (getf statistics key 0))
                     most-busy (max most-busy (getf statistics :busy-threads 0)))))
           (sleep 1)
        finally (return (list most-of-key most-busy))))

(defun run-slow-clients-load (core sampled-key run-clients report &key ssl)
  "Start our server in its own process (from CORE); run the slow clients,
(FUNCALL RUN-CLIENTS PORT), against it with the separate client of
bench/connections.lisp and a sampler of the server's SAMPLED-KEY and busy
threads.  With SSL, the clients and the separate client go to an SSL
acceptor of the same process, whose port RUN-CLIENTS gets.  Returns what
REPORT returns, called with the clients, the separate client's timings,
the sampled peaks, the server's final statistics and its peak RSS in MB."
  (let* ((port (free-port))
         (ssl-port (and ssl (free-port)))
         (certificate-directory (and ssl (make-bench-certificate)))
         (process (launch-server '(:lisp :parallel) port 0 core "/dev/null"
                                 :ssl-port ssl-port
                                 :ssl-certificate (and ssl (merge-pathnames "cert.pem" certificate-directory))
                                 :ssl-key (and ssl (merge-pathnames "key.pem" certificate-directory))))
         (load-port (or ssl-port port)))
    (unwind-protect
         (progn
           (unless (wait-until-serving port)
             (error "The server did not answer GET /yo within 30 s."))
           (let* ((stop-flag (list nil))
                  (separate (bt:make-thread (lambda ()
                                              (measure-separate-client load-port stop-flag
                                                                       (if ssl #'timed-tls-get #'timed-get)))
                                            :name "separate client"))
                  (sampler (bt:make-thread (lambda () (sample-pool-peaks port sampled-key stop-flag))
                                           :name "pool sampler"))
                  (clients (unwind-protect (funcall run-clients load-port)
                             (setf (car stop-flag) t))))
             (funcall report clients (bt:join-thread separate) (bt:join-thread sampler)
                      (server-pool-statistics port) (peak-rss-megabytes (uiop:process-info-pid process)))))
      (stop-server process)
      (when certificate-directory
        (uiop:delete-directory-tree certificate-directory :validate t)))))

(defun report-checks (slow-clients-description all-whole-p timings statistics)
  "Print the separate client's figures and the pass/FAIL lines: every slow
client served whole (ALL-WHOLE-P), the pool within max-thread-count, the
separate client's p99 under 100 ms with none failed.  True when all hold."
  (let* ((latencies (sort (remove nil timings) #'<))
         (failures (count nil timings))
         (p99 (percentile latencies 0.99))
         (peak-threads (getf statistics :peak-threads))
         (checks `((,slow-clients-description ,all-whole-p)
                   ("pool never above max-thread-count (100)" ,(and peak-threads (<= peak-threads 100)))
                   ("separate client p99 under 100 ms, none failed" ,(and (< p99 100) (zerop failures))))))
    (format t "separate client: ~D requests on new connections, ~D failed, p50 ~,1F ms, p99 ~,1F ms, max ~,1F ms~%"
            (length timings) failures (percentile latencies 0.5) p99 (if latencies (car (last latencies)) 0))
    (loop for (description holds) in checks
          do (format t "~:[FAIL~;pass~]: ~A~%" holds description))
    (every #'second checks)))

(defun run-slow-readers-load (&key (connections 1000) (seconds 60) (megabytes 1) core)
  "Run CONNECTIONS slow readers asking MEGABYTES MiB each against our server
with the separate client, print the findings and pass/FAIL lines.  True
when every check holds."
  (run-slow-clients-load
   core :unsent-replies
   (lambda (port) (run-slow-readers port connections seconds megabytes))
   (lambda (readers timings peaks statistics rss)
     (destructuring-bind (most-unsent most-busy) peaks
       (let ((opened (count nil readers :test-not #'eq))
             (whole (count-if (lambda (reader)
                                (and reader (eq (reader-state reader) :done) (eql 200 (reader-status reader))
                                     (= (reader-body-received reader) (* megabytes 1024 1024))))
                              readers))
             (cut (count-if (lambda (reader) (and reader (eq (reader-state reader) :closed))) readers)))
         (format t "~&~D slow readers, each asking ~D MiB and reading 1 KiB a second for ~D s, then the rest~%"
                 connections megabytes seconds)
         (format t "slow readers: ~D connected, ~D replies whole, ~D cut by the server, ~D unfinished~%"
                 opened whole cut (- opened whole cut))
         (format t "server: peak ~D worker threads, at most ~D busy, up to ~D replies unsent at once, ~D write timeouts, peak RSS ~D MB~%"
                 (getf statistics :peak-threads) most-busy most-unsent (getf statistics :write-timeouts) rss)
         (report-checks "every slow reader got its reply whole" (= whole connections) timings statistics))))))

;;; Slow bodies.

(defconstant +slow-send-octets+ 1024
  "What a slow sender sends each second.")

(defstruct (slow-sender (:conc-name sender-))
  (socket nil)
  (fd -1 :type fixnum)
  ;; :SENDING while its body goes out, :READING once all of it has gone,
  ;; :DONE with the whole reply; :CLOSED when the server ended the
  ;; connection first.
  (state :sending :type keyword)
  (due 0 :type fixnum)
  ;; How many octets of the body, as it goes on the wire (the load's
  ;; WIRE-BODY), have been sent.
  (sent 0 :type fixnum)
  (reply (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)))

(defun wire-body (body-octets chunked-p)
  "A body of BODY-OCTETS octets as it goes on the wire: as it is, or, when
CHUNKED-P, in chunks of a second's worth each, then the last chunk."
  (let ((data (make-array +slow-send-octets+ :element-type '(unsigned-byte 8) :initial-element 97)))
    (if (not chunked-p)
        (make-array body-octets :element-type '(unsigned-byte 8) :initial-element 97)
        (flet ((crlf-line (text) (octets-of (format nil "~A~C~C" text #\Return #\Linefeed))))
          (apply #'concatenate '(simple-array (unsigned-byte 8) (*))
                 (append (loop for start from 0 below body-octets by +slow-send-octets+
                               for size = (min +slow-send-octets+ (- body-octets start))
                               collect (crlf-line (format nil "~X" size))
                               collect (subseq data 0 size)
                               collect (crlf-line ""))
                         (list (crlf-line "0") (crlf-line ""))))))))

(defun open-slow-sender (port body-octets chunked-p)
  "A slow sender that has sent the head of a POST to /body-length declaring
BODY-OCTETS, or a chunked body when CHUNKED-P; NIL when it could not
connect."
  (handler-case
      (let* ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp))
             (fd (progn (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port)
                        (sb-bsd-sockets:socket-file-descriptor socket))))
        (hrt::send-without-waiting
         fd (octets-of (format nil "POST /body-length HTTP/1.1~C~CHost: 127.0.0.1~C~CContent-Type: application/octet-stream~C~C~A~C~C~C~C"
                               #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed
                               (if chunked-p
                                   "Transfer-Encoding: chunked"
                                   (format nil "Content-Length: ~D" body-octets))
                               #\Return #\Linefeed #\Return #\Linefeed)))
        (make-slow-sender :socket socket :fd fd :due (seconds-from-now (random 1.0))))
    (error () nil)))

(defun send-some (sender wire-body limit)
  "Send up to LIMIT more octets of WIRE-BODY, SENDER's body; true when some went."
  (let* ((start (sender-sent sender))
         (count (hrt::send-octets (sender-fd sender) wire-body start
                                  (min (length wire-body) (+ start limit)))))
    (cond ((eq count :would-block) nil)
          ((eq count :error) (setf (sender-state sender) :closed) nil)
          (t (when (= (incf (sender-sent sender) count) (length wire-body))
               (setf (sender-state sender) :reading))
             (plusp count)))))

(defun reply-whole-p (reply)
  "True when the octets of REPLY hold a whole head and Content-Length body."
  (let ((head-end (search #(13 10 13 10) reply)))
    (and head-end
         (let ((match (nth-value 1 (cl-ppcre:scan-to-strings "(?i)content-length:\\s*(\\d+)"
                                                             (map 'string #'code-char (subseq reply 0 head-end))))))
           (and match (>= (length reply) (+ head-end 4 (parse-integer (aref match 0)))))))))

(defun receive-some (sender buffer)
  "Read what has come of SENDER's reply; true when some came."
  (let ((count (hrt::receive-available (sender-fd sender) buffer 0 (length buffer))))
    (cond ((eq count :would-block) nil)
          ((or (eq count :error) (eql count 0)) (setf (sender-state sender) :closed) nil)
          (t (loop for index below count do (vector-push-extend (aref buffer index) (sender-reply sender)))
             (when (reply-whole-p (sender-reply sender))
               (setf (sender-state sender) :done))
             t))))

(defun echoed-length (sender)
  "The body length SENDER's reply echoes, when it is a whole 200 reply."
  (let* ((reply (sender-reply sender))
         (head-end (search #(13 10 13 10) reply)))
    (and (eq (sender-state sender) :done)
         (eql 200 (reply-status reply))
         (parse-integer (map 'string #'code-char (subseq reply (+ head-end 4))) :junk-allowed t))))

(defun run-slow-senders (port connection-count seconds kilobytes chunked-p)
  "Open CONNECTION-COUNT slow senders (up to 100 a tick) with a body of
KILOBYTES KiB each (chunked when CHUNKED-P), send 1 KiB of each a second
for SECONDS, then the rest and read the replies as fast as they go, for
120 s at most.  Returns the senders."
  (let ((senders (make-array connection-count :initial-element nil))
        (wire-body (wire-body (* kilobytes 1024) chunked-p))
        (buffer (make-array 4096 :element-type '(unsigned-byte 8))))
    (flet ((unfinished-p (sender) (and sender (member (sender-state sender) '(:sending :reading)))))
      (unwind-protect
           (progn
             (loop for index below connection-count
                   do (setf (aref senders index) (open-slow-sender port (* kilobytes 1024) chunked-p))
                      (when (zerop (mod (1+ index) 100)) (sleep 0.01)))
             (loop with end = (seconds-from-now seconds)
                   until (>= (now) end)
                   do (loop for sender across senders
                            when (and (unfinished-p sender) (<= (sender-due sender) (now)))
                              do (if (eq (sender-state sender) :sending)
                                     (send-some sender wire-body +slow-send-octets+)
                                     (receive-some sender buffer))
                                 (setf (sender-due sender) (seconds-from-now 1)))
                      (sleep 0.01))
             (loop with end = (seconds-from-now 120)
                   while (and (< (now) end) (some #'unfinished-p senders))
                   do (unless (loop for sender across senders
                                    count (case (and sender (sender-state sender))
                                            (:sending (send-some sender wire-body 65536))
                                            (:reading (receive-some sender buffer))))
                        (sleep 0.005))))
        (loop for sender across senders
              when sender do (ignore-errors (sb-bsd-sockets:socket-close (sender-socket sender))))))
    senders))

(defun run-slow-bodies-load (&key (connections 1000) (seconds 60) (kilobytes 100) chunked core)
  "Run CONNECTIONS slow senders of KILOBYTES KiB bodies (chunked when
CHUNKED) against our server with the separate client, print the findings
and pass/FAIL lines.  True when every check holds."
  (run-slow-clients-load
   core :arriving-bodies
   (lambda (port) (run-slow-senders port connections seconds kilobytes chunked))
   (lambda (senders timings peaks statistics rss)
     (destructuring-bind (most-arriving most-busy) peaks
       (let ((opened (count nil senders :test-not #'eq))
             (echoed (count-if (lambda (sender) (and sender (eql (* kilobytes 1024) (echoed-length sender))))
                               senders))
             (cut (count-if (lambda (sender) (and sender (eq (sender-state sender) :closed))) senders)))
         (format t "~&~D slow senders, each POSTing ~D KiB~:[~; chunked~] at 1 KiB a second for ~D s, then the rest~%"
                 connections kilobytes chunked seconds)
         (format t "slow senders: ~D connected, ~D bodies echoed whole, ~D cut by the server, ~D unfinished~%"
                 opened echoed cut (- opened echoed cut))
         (format t "server: peak ~D worker threads, at most ~D busy, up to ~D bodies arriving at once, ~D body timeouts, peak RSS ~D MB~%"
                 (getf statistics :peak-threads) most-busy most-arriving
                 (getf statistics :body-timeout-replies) rss)
         (report-checks "every slow body arrived and its length was echoed" (= echoed connections)
                        timings statistics))))))

;;; Stalled TLS handshakes.

(defparameter *half-client-hello* (coerce #(22 3 1 0 200 1 0 0 196 3 3) '(simple-array (unsigned-byte 8) (*)))
  "A TLS record header announcing a 200-octet ClientHello, and its first
octets: the server's handshake waits for the rest.")

(defun make-bench-certificate ()
  "A new directory holding cert.pem and key.pem for 127.0.0.1."
  (let ((directory (uiop:ensure-directory-pathname
                    (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string)))))
    (uiop:run-program (list "openssl" "req" "-x509" "-newkey" "rsa:2048" "-nodes"
                            "-keyout" (namestring (merge-pathnames "key.pem" directory))
                            "-out" (namestring (merge-pathnames "cert.pem" directory))
                            "-days" "2" "-subj" "/CN=127.0.0.1")
                      :output nil :error-output nil)
    directory))

(defun timed-tls-get (port)
  "Milliseconds one GET /yo over TLS on a new connection took, or NIL (and
a line on *ERROR-OUTPUT* saying why) if it failed or took over 10 s."
  (let ((start (precise-milliseconds)))
    (flet ((failed (reason)
             (format *error-output* "~&separate TLS client: ~A~%" reason)
             nil))
      (handler-case
          ;; cl+ssl waits for its non-blocking socket in SBCL's
          ;; WAIT-UNTIL-FD-USABLE, which a deadline ends: nothing is
          ;; interrupted inside OpenSSL.
          (sb-sys:with-deadline (:seconds 10)
            (let ((socket (usocket:socket-connect "127.0.0.1" port :element-type '(unsigned-byte 8) :timeout 10)))
              (unwind-protect
                   (let ((stream (cl+ssl:make-ssl-client-stream (usocket:socket-stream socket) :verify nil))
                         (buffer (make-array 4096 :element-type '(unsigned-byte 8)))
                         (fill 0))
                     (write-sequence *yo-request* stream)
                     (finish-output stream)
                     (loop (let ((byte (read-byte stream nil)))
                             (unless byte
                               (return (failed (format nil "closed after ~D octets of the reply" fill))))
                             (setf (aref buffer fill) byte)
                             (incf fill)
                             (when (reply-length buffer fill)
                               (return (if (eql 200 (reply-status buffer))
                                           (- (precise-milliseconds) start)
                                           (failed (format nil "status ~D" (reply-status buffer)))))))))
                (usocket:socket-close socket))))
        (serious-condition (condition) (failed condition))))))

(defstruct (stalled-handshake (:conc-name stalled-))
  (socket nil)
  (half-hello-p nil)
  (opened 0 :type fixnum))

(defun open-stalled-handshake (port epoll-fd index half-hello-p)
  "A connection to PORT that sends nothing, or half a ClientHello when
HALF-HELLO-P, watched in EPOLL-FD as INDEX; NIL when it could not connect."
  (handler-case
      (let* ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp))
             (fd (progn (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port)
                        (sb-bsd-sockets:socket-file-descriptor socket))))
        (when half-hello-p
          (hrt::send-without-waiting fd *half-client-hello*))
        (hrt::epoll-watch epoll-fd fd index)
        (make-stalled-handshake :socket socket :half-hello-p half-hello-p :opened (now)))
    (error () nil)))

(defun run-stalled-handshakes (port count seconds)
  "Hold COUNT connections to PORT that send nothing and COUNT that send half
a ClientHello for SECONDS, replacing each the server closes.  Returns the
connections opened, the seconds each closed silent one lived, the same of
the half-ClientHello ones, and the number of connections that could not be
opened."
  (let ((epoll-fd (hrt::make-epoll-set))
        (handshakes (make-array (* 2 count) :initial-element nil))
        (opened 0)
        (failed 0)
        (silent-lifetimes '())
        (half-hello-lifetimes '()))
    (flet ((open-at (index)
             (let ((handshake (open-stalled-handshake port epoll-fd index (>= index count))))
               (if handshake (incf opened) (incf failed))
               (setf (aref handshakes index) handshake))))
      (unwind-protect
           (progn
             (dotimes (index (length handshakes))
               (open-at index)
               (when (zerop (mod (1+ index) 100)) (sleep 0.01)))
             (loop with end = (seconds-from-now seconds)
                   while (< (now) end)
                   do (let ((token (hrt::epoll-wait-one epoll-fd 100)))
                        (when (integerp token)
                          (let ((handshake (aref handshakes token)))
                            (when handshake
                              (if (stalled-half-hello-p handshake)
                                  (push (elapsed-seconds (stalled-opened handshake)) half-hello-lifetimes)
                                  (push (elapsed-seconds (stalled-opened handshake)) silent-lifetimes))
                              (ignore-errors (sb-bsd-sockets:socket-close (stalled-socket handshake))))
                            (open-at token))))))
        (loop for handshake across handshakes
              when handshake do (ignore-errors (sb-bsd-sockets:socket-close (stalled-socket handshake))))
        (hrt::close-fd epoll-fd)))
    (values opened silent-lifetimes half-hello-lifetimes failed)))

(defconstant +silent-client-handover-seconds+ 15.5
  "When the kernel hands over a connection that has sent nothing to a
listening socket deferring accepts for 10 s (the header timeout): it rounds
the deferral up to its fourth SYN-ACK retransmission (measured 15.5 s).")

(defun lifetimes-summary (sorted)
  (if sorted
      (format nil "~D closed by the server after ~,1F to ~,1F s (p50 ~,1F s)"
              (length sorted) (first sorted) (car (last sorted)) (percentile sorted 0.5))
      "none closed by the server"))

(defun run-tls-handshakes-load (&key (connections 1000) (seconds 60) core)
  "Run CONNECTIONS silent and CONNECTIONS half-ClientHello connections against
our SSL acceptor (header timeout 10 s, :DEFER-ACCEPT by default) with a
separate client over TLS, print the findings and pass/FAIL lines.  True
when every check holds: a half ClientHello is closed at the header timeout;
a silent client, which the kernel hands over only when its deferral ends,
at the header timeout after that, never before the header timeout."
  (run-slow-clients-load
   core :tls-handshakes
   (lambda (port) (multiple-value-list (run-stalled-handshakes port connections seconds)))
   (lambda (results timings peaks statistics rss)
     (destructuring-bind (opened silent-lifetimes half-hello-lifetimes failed) results
       (destructuring-bind (most-handshakes most-busy) peaks
         (let* ((silent (sort (copy-list silent-lifetimes) #'<))
                (half-hello (sort (copy-list half-hello-lifetimes) #'<))
                (silent-latest (+ +silent-client-handover-seconds+ 11.5))
                (off-time (+ (count-if (lambda (lifetime) (not (<= 9.5 lifetime 11.5))) half-hello)
                             (count-if (lambda (lifetime) (not (<= 9.5 lifetime silent-latest))) silent))))
           (format t "~&~D connections to the SSL acceptor sending nothing and ~D half a ClientHello, for ~D s, each closed one replaced~%"
                   connections connections seconds)
           (format t "stalled handshakes: ~D opened, ~D could not connect~%  half a ClientHello: ~A~%  silent: ~A~%  ~D closed outside 9.5 to 11.5 s (half a ClientHello) or 9.5 to ~,1F s (silent)~%"
                   opened failed (lifetimes-summary half-hello) (lifetimes-summary silent) off-time silent-latest)
           (format t "server: peak ~D worker threads, at most ~D busy, up to ~D handshakes waiting at once, ~D handshake timeouts, peak RSS ~D MB~%"
                   (getf statistics :peak-threads) most-busy most-handshakes
                   (getf statistics :handshake-timeouts) rss)
           (report-checks "every stalled handshake closed at the header timeout (10 s; a silent one after the kernel hands it over), none refused"
                          (and half-hello (zerop off-time) (zerop failed))
                          timings statistics)))))
   :ssl t))
