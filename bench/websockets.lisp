;;;; bench/run websockets: the websocket load, ours (a parallel acceptor at
;;;; its defaults) and hunchensocket on Hunchentoot's acceptor side by side,
;;;; each server in a process of its own.  Phases, on one server, while a
;;;; separate client times a GET /yo on a new connection every 20 ms:
;;;;
;;;;   idle       IDLE websockets opened on /ws/chat and left idle: worker
;;;;              threads, and the RSS each adds (after a full GC).
;;;;   broadcast  one of them sends a message to /ws/chat: how long until
;;;;              every one has it.
;;;;   echo       ECHO more websockets on /ws/echo, each sending 10 messages
;;;;              a second for SECONDS: every echo back, in order, and the
;;;;              p99 of their round trips.
;;;;   mute       on /ws/room, 100 websockets and one that reads nothing;
;;;;              one of the 100 broadcasts 4 KiB messages at full speed
;;;;              (its next once it has its last) for up to 40 s: the others
;;;;              get every one, in order, and the mute one is closed.
;;;;
;;;; The clients are one thread on an epoll set, through the library's own
;;;; foreign calls, as bench/connections.lisp's.  Client frames are masked
;;;; with the key 0 (RFC 6455 asks for a mask, any four octets).

(in-package #:hunchentoot-recycling-taskmaster-bench)

;;; Ours: the resources the load uses.

(defclass bench-echo-resource (ws:websocket-resource) ())

(defmethod ws:text-message-received ((resource bench-echo-resource) client message)
  (ws:send-text-message client message))

(defclass bench-chat-resource (ws:websocket-resource) ())

(defmethod ws:text-message-received ((resource bench-chat-resource) client message)
  (declare (ignore client))
  (dolist (peer (ws:clients resource))
    (ws:send-text-message peer message)))

(defvar *bench-websocket-resources*
  (list (cons "/ws/echo" (make-instance 'bench-echo-resource))
        (cons "/ws/chat" (make-instance 'bench-chat-resource))
        (cons "/ws/room" (make-instance 'bench-chat-resource))))

(defun find-bench-websocket-resource (request)
  (cdr (assoc (ht:script-name request) *bench-websocket-resources* :test #'string=)))

(pushnew 'find-bench-websocket-resource ws:*websocket-dispatch-table*)

(defparameter *hunchensocket-peer*
  '(:name "hunchensocket" :label "hunchensocket on Hunchentoot's acceptor" :peer "hunchensocket"
    :system "hunchensocket" :vendor-folders ("hunchensocket" "sha1"))
  "The websocket load's peer, built as the matrix's peers are (peers.lisp).")

;;; A client.

(defstruct (websocket-client (:conc-name wsc-))
  (socket nil)
  (fd -1 :type fixnum)
  ;; :HANDSHAKE (101 awaited), :OPEN, :CLOSED.
  (state :handshake)
  (group :idle)
  (buffer (make-array 1024 :element-type '(unsigned-byte 8)) :type (simple-array (unsigned-byte 8) (*)))
  (fill 0 :type fixnum)
  ;; Echo: the next sequence number to send and to receive, send times
  ;; (precise milliseconds) of those awaited, when to send next.
  (next-sent 0 :type fixnum)
  (next-received 0 :type fixnum)
  (sent-times (make-array 0 :adjustable t :fill-pointer t))
  (due most-positive-fixnum)
  ;; Messages received, and those out of order.
  (received 0 :type fixnum)
  (out-of-order 0 :type fixnum)
  ;; What the last message said, and when it came (precise milliseconds).
  (last-message nil)
  (last-message-at 0)
  ;; True when the server sent a close frame.
  (close-code nil))

(defparameter *websocket-request-format*
  (format nil "GET ~~A HTTP/1.1~C~CHost: 127.0.0.1~C~CUpgrade: websocket~C~CConnection: Upgrade~C~C~
               Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==~C~CSec-WebSocket-Version: 13~C~C~C~C"
          #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed
          #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed))

(defun client-frame (opcode payload)
  "A client frame of OPCODE carrying the octets PAYLOAD, masked with the key 0."
  (let* ((length (length payload))
         (head (if (< length 126) 6 8))
         (frame (make-array (+ head length) :element-type '(unsigned-byte 8) :initial-element 0)))
    (setf (aref frame 0) (logior #x80 opcode))
    (if (< length 126)
        (setf (aref frame 1) (logior #x80 length))
        (setf (aref frame 1) (logior #x80 126)
              (aref frame 2) (ldb (byte 8 8) length)
              (aref frame 3) (ldb (byte 8 0) length)))
    (replace frame payload :start1 head)
    frame))

(defun send-client-text (client text)
  (hrt::send-without-waiting (wsc-fd client) (client-frame 1 (octets-of text))))

(defun open-websocket-client (port epoll-fd token group path)
  "A websocket client connected to PATH, its handshake sent, watched in
EPOLL-FD under TOKEN; NIL when it could not connect."
  (handler-case
      (let* ((socket (usocket:socket-connect "127.0.0.1" port :element-type '(unsigned-byte 8) :timeout 5))
             (client (make-websocket-client :socket socket :fd (hrt::socket-file-descriptor socket) :group group)))
        (hrt::epoll-watch epoll-fd (wsc-fd client) token)
        (hrt::send-without-waiting (wsc-fd client) (octets-of (format nil *websocket-request-format* path)))
        client)
    (error () nil)))

(defun close-websocket-client (client)
  (setf (wsc-state client) :closed)
  (ignore-errors (usocket:socket-close (wsc-socket client))))

(defun note-message (client text)
  "CLIENT received the text message TEXT: an echo is checked against the
sequence it sent; a broadcast is noted with its time."
  (incf (wsc-received client))
  (setf (wsc-last-message client) text
        (wsc-last-message-at client) (precise-milliseconds))
  (when (member (wsc-group client) '(:echo :echo-done))
    (let ((sequence (parse-integer text :junk-allowed t)))
      (if (eql sequence (wsc-next-received client))
          (let ((sent (aref (wsc-sent-times client) sequence)))
            (incf (wsc-next-received client))
            (setf (aref (wsc-sent-times client) sequence) (- (precise-milliseconds) sent)))
          (incf (wsc-out-of-order client))))))

(defun take-frames (client)
  "Act on the whole frames at the start of CLIENT's buffer."
  (let ((buffer (wsc-buffer client))
        (position 0))
    (loop
      (let ((fill (wsc-fill client)))
        (when (< (- fill position) 2) (return))
        (let* ((short (ldb (byte 7 0) (aref buffer (1+ position))))
               (head (case short (126 4) (127 10) (t 2)))
               (length (when (<= (+ position head) fill)
                         (case short
                           (126 (+ (ash (aref buffer (+ position 2)) 8) (aref buffer (+ position 3))))
                           (127 (loop with value = 0 for index from (+ position 2) below (+ position 10)
                                      do (setf value (+ (ash value 8) (aref buffer index)))
                                      finally (return value)))
                           (t short)))))
          (unless (and length (<= (+ position head length) fill)) (return))
          (let ((opcode (ldb (byte 4 0) (aref buffer position)))
                (start (+ position head))
                (end (+ position head length)))
            (case opcode
              (1 (note-message client (map 'string #'code-char (subseq buffer start end))))
              (8 (setf (wsc-close-code client)
                       (if (>= length 2) (+ (ash (aref buffer start) 8) (aref buffer (1+ start))) 1005)))
              (9 (hrt::send-without-waiting (wsc-fd client) (client-frame 10 (subseq buffer start end)))))
            (setf position end)))))
    (replace buffer buffer :start2 position :end2 (wsc-fill client))
    (decf (wsc-fill client) position)))

(defun read-websocket-client (client)
  "Take what has arrived on CLIENT: the 101, then frames."
  (multiple-value-bind (buffer count) (receive-growing (wsc-fd client) (wsc-buffer client) (wsc-fill client))
    (setf (wsc-buffer client) buffer)
    (cond ((eq count :would-block))
          ((or (eq count :error) (eql count 0)) (close-websocket-client client))
          (t (incf (wsc-fill client) count)
             (when (eq (wsc-state client) :handshake)
               (multiple-value-bind (status fill) (take-reply-head (wsc-buffer client) (wsc-fill client))
                 (cond ((null status))
                       ((eql 101 status) (setf (wsc-state client) :open
                                               (wsc-fill client) fill))
                       (t (close-websocket-client client)))))
             (when (eq (wsc-state client) :open)
               (take-frames client))))))

;;; The load's loop.

(defstruct (websocket-load (:conc-name load-))
  (port 0)
  (epoll-fd (hrt::make-epoll-set))
  (clients (make-array 0 :adjustable t :fill-pointer t)))

(defun add-clients (load count group path &key (per-second 1000) (deadline-seconds 60))
  "Open COUNT websockets of GROUP on PATH, at most PER-SECOND a second, and
wait (serving the others) until each is open or refused, or DEADLINE-SECONDS
pass.  Returns the new clients that are open."
  (let ((new '())
        (deadline (seconds-from-now deadline-seconds))
        (opened 0))
    (loop while (and (< opened count) (< (now) deadline))
          do (loop repeat (max 1 (floor per-second 100))
                   while (< opened count)
                   do (let* ((token (fill-pointer (load-clients load)))
                             (client (open-websocket-client (load-port load) (load-epoll-fd load) token group path)))
                        (incf opened)
                        (vector-push-extend client (load-clients load))
                        (when client (push client new))))
             (serve-clients load 0.01))
    (loop until (or (notany (lambda (client) (eq (wsc-state client) :handshake)) new)
                    (>= (now) deadline))
          do (serve-clients load 0.05))
    (remove-if-not (lambda (client) (eq (wsc-state client) :open)) new)))

(defun serve-clients (load seconds &optional (mute nil))
  "For SECONDS, read what arrives for every client but MUTE, and send the
echo clients' messages when due."
  (let ((end (seconds-from-now seconds))
        (clients (load-clients load)))
    (loop
      (let ((now (now)))
        (when (>= now end) (return))
        (loop for client across clients
              when (and client (eq (wsc-group client) :echo) (eq (wsc-state client) :open)
                        (<= (wsc-due client) now))
                do (vector-push-extend (precise-milliseconds) (wsc-sent-times client))
                   (send-client-text client (format nil "~D echo" (wsc-next-sent client)))
                   (incf (wsc-next-sent client))
                   (setf (wsc-due client) (+ (wsc-due client) (floor internal-time-units-per-second 10))))
        (loop for token = (hrt::epoll-wait-one (load-epoll-fd load) 5)
              until (member token '(:timeout))
              unless (eq token :interrupted)
                do (let ((client (aref clients token)))
                     (when (and client (not (eq client mute)) (not (eq (wsc-state client) :closed)))
                       (read-websocket-client client)))
              until (>= (now) end))))))

(defun end-load (load)
  (loop for client across (load-clients load)
        when client do (close-websocket-client client))
  (hrt::close-fd (load-epoll-fd load)))

;;; The phases.

(defun server-rss-after-gc (port pid)
  (http-get port "/gc")
  (/ (process-status-number pid "VmRSS:") 1024.0))

(defun worker-threads (port pid)
  "Ours: the pool's worker threads; the peer: every thread of its process."
  (let ((statistics (server-pool-statistics port)))
    (or (getf statistics :threads) (process-status-number pid "Threads:"))))

(defun broadcast-phase (load clients)
  "One of CLIENTS broadcasts; milliseconds until every one had it (NIL if some never did within 10 s)."
  (let ((message (format nil "broadcast ~D" (random 1000000)))
        (start (precise-milliseconds)))
    (send-client-text (first clients) message)
    (loop with deadline = (seconds-from-now 10)
          until (or (every (lambda (client) (equal message (wsc-last-message client))) clients)
                    (>= (now) deadline))
          do (serve-clients load 0.01))
    (and (every (lambda (client) (equal message (wsc-last-message client))) clients)
         (- (reduce #'max clients :key #'wsc-last-message-at) start))))

(defun echo-phase (load clients seconds)
  "CLIENTS send 10 messages a second each for SECONDS, then get 5 s for the
last echoes.  Returns the round trips (milliseconds, sorted), the messages
not echoed, and those echoed out of order."
  (let ((start (now)))
    (loop for client in clients
          do (setf (wsc-due client) (+ start (random internal-time-units-per-second))))
    (serve-clients load seconds)
    (loop for client in clients do (setf (wsc-group client) :echo-done))
    (loop with deadline = (seconds-from-now 5)
          until (or (every (lambda (client) (= (wsc-next-received client) (wsc-next-sent client))) clients)
                    (>= (now) deadline))
          do (serve-clients load 0.05))
    (values (sort (loop for client in clients
                        nconc (loop for index below (wsc-next-received client)
                                    collect (aref (wsc-sent-times client) index)))
                  #'<)
            (loop for client in clients sum (- (wsc-next-sent client) (wsc-next-received client)))
            (loop for client in clients sum (wsc-out-of-order client)))))

(defun mute-closed-p (mute)
  "Read what the server sent MUTE, all of it: true when the server has
closed the connection (it sends its close frame, then FIN)."
  (let ((scratch (make-array 65536 :element-type '(unsigned-byte 8))))
    (loop with deadline = (seconds-from-now 10)
          for count = (hrt::receive-available (wsc-fd mute) scratch 0 65536)
          do (cond ((or (eql count 0) (eq count :error)) (return t))
                   ((eq count :would-block)
                    (unless (hrt::wait-until-fd-readable (wsc-fd mute) 100)
                      (return nil))))
          until (>= (now) deadline))))

(defun mute-phase (load clients mute)
  "The first of CLIENTS broadcasts 4 KiB messages on /ws/room, each once it
has its last, for up to 40 s, or until the server (ours) says it closed a
websocket with 1008.  Returns the broadcasts, whether every other client
got each in order, and whether MUTE was closed."
  (let ((sender (first clients))
        (padding (make-string 4096 :initial-element #\m))
        (deadline (seconds-from-now 40))
        (sent 0))
    (flet ((closed-1008-p ()
             (let ((closes (getf (server-pool-statistics (load-port load)) :websocket-closes)))
               (plusp (or (cdr (assoc 1008 closes)) 0)))))
      (loop until (or (>= (now) deadline) (and (zerop (mod sent 50)) (closed-1008-p)))
            do (send-client-text sender (format nil "~D ~A" sent padding))
               (incf sent)
               (loop with wait-until = (seconds-from-now 5)
                     until (or (eql (wsc-received sender) sent) (>= (now) wait-until))
                     do (serve-clients load 0.001 mute)))
      (serve-clients load 1 mute)
      (values sent
              (every (lambda (client) (= (wsc-received client) sent)) clients)
              (mute-closed-p mute)))))

;;; The run.

(defun run-websocket-phases (port pid idle echo seconds)
  "The phases against the server on PORT (process PID); a plist of findings."
  (let* ((load (make-websocket-load :port port))
         (rss-before (server-rss-after-gc port pid))
         (findings '()))
    (unwind-protect
         (let* ((idle-clients (add-clients load idle :idle "/ws/chat"))
                (rss-idle (progn (serve-clients load 2) (server-rss-after-gc port pid)))
                (threads-idle (worker-threads port pid)))
           (setf findings (list :idle-opened (length idle-clients) :rss-before rss-before :rss-idle rss-idle
                                :threads-idle threads-idle))
           (when idle-clients
             (setf (getf findings :broadcast-ms) (broadcast-phase load idle-clients)))
           (let ((echo-clients (add-clients load echo :echo "/ws/echo" :deadline-seconds 30)))
             (setf (getf findings :echo-opened) (length echo-clients))
             (when echo-clients
               (multiple-value-bind (round-trips missing out-of-order) (echo-phase load echo-clients seconds)
                 (setf (getf findings :echoes) (length round-trips)
                       (getf findings :echo-missing) missing
                       (getf findings :echo-out-of-order) out-of-order
                       (getf findings :echo-p50) (percentile round-trips 0.5)
                       (getf findings :echo-p99) (percentile round-trips 0.99)))))
           (let ((room (add-clients load 100 :room "/ws/room" :deadline-seconds 30))
                 (mute (first (add-clients load 1 :mute "/ws/room" :deadline-seconds 30))))
             (setf (getf findings :room-opened) (length room))
             (when mute
               ;; It reads nothing from now on: not even its readiness.
               (hrt::epoll-disarm (load-epoll-fd load) (wsc-fd mute) (position mute (load-clients load))))
             (when (and room mute)
               (multiple-value-bind (sent in-order closed) (mute-phase load room mute)
                 (setf (getf findings :room-broadcasts) sent
                       (getf findings :room-in-order) in-order
                       (getf findings :mute-closed) closed))))
           (setf (getf findings :threads-end) (worker-threads port pid))
           findings)
      (end-load load))))

(defun websocket-checks (findings idle echo timings)
  "The pass/FAIL lines of the issue's targets for FINDINGS."
  (let* ((latencies (sort (remove nil timings) #'<))
         (opened (getf findings :idle-opened 0))
         (per-websocket-kb (and (plusp opened)
                                (/ (* 1024 (- (getf findings :rss-idle 0) (getf findings :rss-before 0))) opened))))
    (values
     `((,(format nil "~D idle websockets open" idle) ,(= opened idle))
       (,(format nil "~D idle websockets on at most 20 worker threads" idle)
        ,(and (= opened idle) (<= (getf findings :threads-idle 1000) 20)))
       ("memory per idle websocket at most 16 KB" ,(and per-websocket-kb (<= per-websocket-kb 16)))
       (,(format nil "a broadcast reaches all ~D within 1 s" idle)
        ,(let ((ms (getf findings :broadcast-ms))) (and (= opened idle) ms (< ms 1000))))
       (,(format nil "~D echo clients: every echo received, in order" echo)
        ,(and (eql (getf findings :echo-opened) echo) (eql 0 (getf findings :echo-missing))
              (eql 0 (getf findings :echo-out-of-order)) (plusp (getf findings :echoes 0))))
       ("echo p99 under 50 ms" ,(let ((p99 (getf findings :echo-p99))) (and p99 (< p99 50))))
       ("a client that reads nothing is closed, the others get every broadcast in order"
        ,(and (getf findings :mute-closed) (getf findings :room-in-order)))
       ("separate HTTP client p99 under 100 ms, none failed"
        ,(and latencies (< (percentile latencies 0.99) 100) (notany #'null timings))))
     per-websocket-kb latencies)))

(defun report-websocket-load (label findings idle echo seconds timings)
  "Print the findings of one server; true when every check passed."
  (multiple-value-bind (checks per-websocket-kb latencies) (websocket-checks findings idle echo timings)
    (format t "~&~%== ~A~%" label)
    (format t "idle: ~D of ~D websockets opened; worker threads ~A; RSS ~,1F MB before, ~,1F MB with them ~
               (after a full GC): ~:[-~;~:*~,1F KB~] per idle websocket~%"
            (getf findings :idle-opened) idle (getf findings :threads-idle)
            (getf findings :rss-before 0) (getf findings :rss-idle 0) per-websocket-kb)
    (format t "broadcast to all: ~:[never reached every one~;~:*~,1F ms~]~%" (getf findings :broadcast-ms))
    (format t "echo: ~D of ~D clients opened, 10 messages/s each for ~D s: ~D echoes, ~D missing, ~D out of order, ~
               p50 ~,1F ms, p99 ~,1F ms~%"
            (getf findings :echo-opened 0) echo seconds (getf findings :echoes 0) (getf findings :echo-missing 0)
            (getf findings :echo-out-of-order 0) (getf findings :echo-p50 0) (getf findings :echo-p99 0))
    (format t "mute client: ~D of 100 room clients opened, ~D broadcasts of 4 KiB, all received in order: ~:[no~;yes~], ~
               the mute client closed by the server: ~:[no~;yes~]~%"
            (getf findings :room-opened 0) (getf findings :room-broadcasts 0)
            (getf findings :room-in-order) (getf findings :mute-closed))
    (format t "worker threads at the end: ~A~%" (getf findings :threads-end))
    (format t "separate client: ~D GETs on new connections, ~D failed, p50 ~,1F ms, p99 ~,1F ms, max ~,1F ms~%"
            (length timings) (count nil timings) (percentile latencies 0.5) (percentile latencies 0.99)
            (if latencies (car (last latencies)) 0))
    (loop for (description holds) in checks
          do (format t "~:[FAIL~;pass~]: ~A~%" holds description))
    (every #'second checks)))

(defun measure-websocket-server (label process port idle echo seconds)
  "Run the phases against PROCESS on PORT with the separate client timing
GETs meanwhile; print them.  True when every check passed."
  (unless (wait-until-serving port)
    (error "~A did not answer GET /yo within 30 s." label))
  (let* ((stop-flag (list nil))
         (separate (bt:make-thread (lambda () (measure-separate-client port stop-flag)) :name "separate client"))
         (findings (unwind-protect (run-websocket-phases port (uiop:process-info-pid process) idle echo seconds)
                     (setf (car stop-flag) t)))
         (timings (bt:join-thread separate)))
    (report-websocket-load label findings idle echo seconds timings)))

(defun run-websockets (&key (idle 10000) (echo 1000) (seconds 60) core)
  "The websocket load against ours, then against hunchensocket when its
sources are in ../shared/vendor.  True when every check passed for ours."
  (format t "~&bench/run websockets: ~D idle websockets, ~D echo clients for ~D s, one mute client among 100~%"
          idle echo seconds)
  (let ((ours-passed
          (let* ((port (free-port))
                 (process (launch-server '(:lisp :parallel) port 0 core "/dev/null")))
            (unwind-protect (measure-websocket-server "ours: parallel-easy-acceptor at its defaults" process port
                                                      idle echo seconds)
              (stop-server process)))))
    (let ((peer (and (every #'probe-file (peer-vendor-folders *hunchensocket-peer*))
                     (build-peer-core *hunchensocket-peer* (namestring (uiop:pathname-directory-pathname core))))))
      (if (null peer)
          (format t "~&~%Not measured: hunchensocket (its sources are not in ~A).~%" (namestring (vendor-directory)))
          (let* ((port (free-port))
                 (process (launch-peer peer port 0 "/dev/null")))
            (unwind-protect (measure-websocket-server (getf peer :label) process port idle echo seconds)
              (stop-server process)))))
    ours-passed))
