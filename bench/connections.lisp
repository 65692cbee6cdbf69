;;;; Many connections against one server: bench/connections runs
;;;; RUN-CONNECTION-LOAD in one of two modes.
;;;;
;;;; :KEEP-ALIVE  CONNECTIONS kept-alive clients, each sending GET /yo every
;;;;              1 to 4.9 s (under the server's 5 s keep-alive timeout).
;;;; :SLOWLORIS   CONNECTIONS clients that send a request line and then one
;;;;              header line a second, never ending the head; each one the
;;;;              server closes is replaced.
;;;;
;;;; Meanwhile a separate client opens a connection for one GET /yo every
;;;; 20 ms and measures how long each takes.  The server is a process of its
;;;; own (SERVE :PARALLEL), so that its peak RSS is its own.  The load is one
;;;; thread waiting on an epoll set, through the library's own foreign calls.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defstruct (load-client (:conc-name client-))
  (socket nil)
  (fd -1 :type fixnum)
  (state :idle :type keyword)       ; :IDLE, :WAITING (for a reply) or :CLOSED
  (due 0 :type fixnum)              ; when to send the next request or header line
  (opened-at 0 :type fixnum)
  (buffer (make-array 4096 :element-type '(unsigned-byte 8)))
  (fill 0 :type fixnum))

(defstruct (load-tally (:conc-name tally-))
  (opened 0) (connect-failures 0) (requests 0) (ok 0) (other-status 0)
  (closed-by-server 0) (answered-408 0) (closed-without-408 0)
  (seconds-to-408 '()))

(defun now () (get-internal-real-time))

(defun seconds-from-now (seconds)
  (+ (now) (round (* seconds internal-time-units-per-second))))

(defun elapsed-seconds (since)
  (/ (- (now) since) internal-time-units-per-second))

(defun octets-of (string) (map '(simple-array (unsigned-byte 8) (*)) #'char-code string))

(defparameter *yo-request* (octets-of (format nil "GET /yo HTTP/1.1~C~CHost: 127.0.0.1~C~C~C~C"
                                              #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed)))

(defparameter *slow-request-start* (octets-of (format nil "GET /yo HTTP/1.1~C~CHost: 127.0.0.1~C~C"
                                                      #\Return #\Linefeed #\Return #\Linefeed)))

(defparameter *slow-header-line* (octets-of (format nil "X-Slow: a~C~C" #\Return #\Linefeed)))

(defun reply-length (buffer fill)
  "The length of the complete reply at the start of BUFFER, or NIL."
  (let ((head-end (search #(13 10 13 10) buffer :end2 fill)))
    (when head-end
      (let* ((head (map 'string #'code-char (subseq buffer 0 head-end)))
             (match (nth-value 1 (cl-ppcre:scan-to-strings "(?i)content-length:\\s*(\\d+)" head)))
             (total (+ head-end 4 (if match (parse-integer (aref match 0)) 0))))
        (and (<= total fill) total)))))

(defun receive-growing (fd buffer fill)
  "Receive what has arrived on FD into BUFFER after its FILL octets,
BUFFER doubled first when it is full: the buffer, and the count received,
0 at end of file, :WOULD-BLOCK or :ERROR."
  (let ((buffer (if (= fill (length buffer))
                    (replace (make-array (* 2 (length buffer)) :element-type '(unsigned-byte 8)) buffer)
                    buffer)))
    (values buffer (hrt::receive-available fd buffer fill (length buffer)))))

(defun reply-status (buffer)
  (parse-integer (map 'string #'code-char (subseq buffer 9 12)) :junk-allowed t))

(defun take-reply-head (buffer fill)
  "When a reply's head ends among the first FILL octets of BUFFER: its
status, and the octets that followed it, moved to BUFFER's start; else NIL."
  (let ((head-end (search #(13 10 13 10) buffer :end2 fill)))
    (when head-end
      (let ((status (reply-status buffer)))
        (replace buffer buffer :start2 (+ head-end 4) :end2 fill)
        (values status (- fill head-end 4))))))

;;; The load.

(defun open-load-client (port epoll-fd index tally mode)
  (handler-case
      (let* ((socket (usocket:socket-connect "127.0.0.1" port :element-type '(unsigned-byte 8)
                                                               :timeout 10))
             (client (make-load-client :socket socket
                                       :fd (hrt::socket-file-descriptor socket)
                                       :opened-at (now))))
        (incf (tally-opened tally))
        (hrt::epoll-watch epoll-fd (client-fd client) index)
        (if (eq mode :slowloris)
            (progn (hrt::send-without-waiting (client-fd client) *slow-request-start*)
                   (setf (client-due client) (seconds-from-now 1)))
            (setf (client-due client) (seconds-from-now (+ 1 (random 3.9)))))
        client)
    (error ()
      (incf (tally-connect-failures tally))
      nil)))

(defun close-load-client (client)
  (setf (client-state client) :closed)
  (ignore-errors (usocket:socket-close (client-socket client))))

(defun send-due (client tally mode)
  (case mode
    (:keep-alive
     (when (eq (client-state client) :idle)
       (hrt::send-without-waiting (client-fd client) *yo-request*)
       (incf (tally-requests tally))
       (setf (client-state client) :waiting)))
    (:slowloris
     (hrt::send-without-waiting (client-fd client) *slow-header-line*)
     (setf (client-due client) (seconds-from-now 1)))))

(defun note-server-closed (client tally mode)
  "The server closed CLIENT's connection."
  (incf (tally-closed-by-server tally))
  (when (eq mode :slowloris)
    (let ((length (reply-length (client-buffer client) (client-fill client))))
      (if (and length (eql 408 (reply-status (client-buffer client))))
          (progn (incf (tally-answered-408 tally))
                 (push (elapsed-seconds (client-opened-at client)) (tally-seconds-to-408 tally)))
          (incf (tally-closed-without-408 tally)))))
  (close-load-client client))

(defun read-replies (client tally mode)
  "Take what CLIENT's connection has received: count complete replies, and
notice the server closing it."
  (let* ((buffer (client-buffer client))
         (count (hrt::receive-available (client-fd client) buffer (client-fill client) (length buffer))))
    (cond ((eq count :would-block))
          ((or (eq count :error) (eql count 0))
           (note-server-closed client tally mode))
          (t
           (incf (client-fill client) count)
           (when (eq mode :keep-alive)
             (let ((length (reply-length buffer (client-fill client))))
               (when length
                 (if (eql 200 (reply-status buffer))
                     (incf (tally-ok tally))
                     (incf (tally-other-status tally)))
                 (replace buffer buffer :start2 length :end2 (client-fill client))
                 (decf (client-fill client) length)
                 (setf (client-state client) :idle
                       (client-due client) (seconds-from-now (+ 1 (random 3.9)))))))))))

(defun run-load (port mode connection-count seconds tally)
  "Hold CONNECTION-COUNT connections of MODE for SECONDS after opening them
(at most 1,000 a second).  Returns the clients still waiting for a reply."
  (let ((epoll-fd (hrt::make-epoll-set))
        (clients (make-array connection-count :initial-element nil))
        (opened 0)
        (end nil))
    (unwind-protect
         (loop
           (let ((now (now)))
             (when (and (null end) (= opened connection-count))
               (setf end (seconds-from-now seconds)))
             (when (and end (>= now end))
               (return (count :waiting clients :key (lambda (client) (and client (client-state client))))))
             ;; Open (or, for slowloris, replace) up to ten connections a tick.
             (loop repeat 10
                   for index = (if (< opened connection-count)
                                   (prog1 opened (incf opened))
                                   (and (eq mode :slowloris)
                                        (position-if (lambda (client) (or (null client) (eq (client-state client) :closed)))
                                                     clients)))
                   while index
                   do (setf (aref clients index) (open-load-client port epoll-fd index tally mode)))
             (loop for client across clients
                   when (and client (not (eq (client-state client) :closed)) (<= (client-due client) now))
                     do (send-due client tally mode))
             (loop for token = (hrt::epoll-wait-one epoll-fd 10)
                   until (eq token :timeout)
                   unless (eq token :interrupted)
                     do (let ((client (aref clients token)))
                          (when (and client (not (eq (client-state client) :closed)))
                            (read-replies client tally mode)))
                   until (>= (elapsed-seconds now) 0.01))))
      (loop for client across clients
            when client do (close-load-client client))
      (hrt::close-fd epoll-fd))))

;;; The separate client.

(defun precise-milliseconds ()
  ;; GET-INTERNAL-REAL-TIME reads a coarse clock on Linux (4 ms steps).
  (multiple-value-bind (seconds microseconds) (sb-ext:get-time-of-day)
    (+ (* 1000 seconds) (/ microseconds 1000.0d0))))

(defun timed-get (port)
  "Milliseconds one GET /yo on a new connection took, or NIL if it failed
or took over 10 s."
  (let ((start (now))
        (precise-start (precise-milliseconds)))
    (handler-case
        (let ((socket (usocket:socket-connect "127.0.0.1" port :element-type '(unsigned-byte 8) :timeout 10)))
          (unwind-protect
               (let ((stream (usocket:socket-stream socket))
                     (buffer (make-array 4096 :element-type '(unsigned-byte 8)))
                     (fill 0))
                 (write-sequence *yo-request* stream)
                 (finish-output stream)
                 (loop
                   ;; The stream may hold bytes already read from the socket.
                   (unless (or (listen stream)
                               (hrt::wait-until-fd-readable
                                (hrt::socket-file-descriptor socket) (max 1 (- 10000 (round (* 1000 (elapsed-seconds start)))))))
                     (return nil))
                   (let ((byte (read-byte stream nil)))
                     (unless byte (return nil))
                     (setf (aref buffer fill) byte)
                     (incf fill)
                     (when (reply-length buffer fill)
                       (return (and (eql 200 (reply-status buffer))
                                    (- (precise-milliseconds) precise-start)))))))
            (ignore-errors (usocket:socket-close socket))))
      (error () nil))))

(defun measure-separate-client (port stop-flag &optional (timed-get #'timed-get))
  "Time a GET every 20 ms, with TIMED-GET, until (CAR STOP-FLAG) is true: the
list of milliseconds, NIL for each failure."
  (loop until (car stop-flag)
        collect (funcall timed-get port)
        do (sleep 0.02)))

(defun sample-pool (port stop-flag)
  "Read the server's pool statistics every second until (CAR STOP-FLAG) is
true: the most parked connections seen, and the last statistics read."
  (loop with most-parked = 0
        with last = nil
        until (car stop-flag)
        do (let ((statistics (server-pool-statistics port)))
             (when statistics
               (setf last statistics
                     most-parked (max most-parked (getf statistics :parked-connections 0)))))
           (sleep 1)
        finally (return (values most-parked last))))

(defun percentile (sorted fraction)
  (if (null sorted) 0 (nth (min (1- (length sorted)) (floor (* fraction (length sorted)))) sorted)))

;;; The run.

(defun server-pool-statistics (port)
  (let ((text (http-get port "/pool-stats")))
    (and text (let ((*read-eval* nil)) (read-from-string text)))))

(defun process-status-number (pid field)
  "The number after FIELD (\"VmHWM:\", \"Threads:\"...) in /proc/PID/status."
  (with-open-file (in (format nil "/proc/~D/status" pid))
    (loop for line = (read-line in nil)
          while line
          when (eql 0 (search field line))
            return (parse-integer line :start (length field) :junk-allowed t))))

(defun peak-rss-megabytes (pid)
  (round (process-status-number pid "VmHWM:") 1024))

(defun run-connection-load (&key (mode :keep-alive) (connections 10000) (seconds 60) core)
  "Start the server, hold the load for SECONDS, print the findings.  True
when every criterion of the mode holds."
  (let* ((port (free-port))
         (process (launch-server '(:lisp :parallel) port 0 core "/dev/null"))
         (tally (make-load-tally)))
    (unwind-protect
         (progn
           (unless (wait-until-serving port)
             (error "The server did not answer GET /yo within 30 s."))
           (let* ((stop-flag (list nil))
                  (separate (bt:make-thread (lambda () (measure-separate-client port stop-flag))
                                            :name "separate client"))
                  (sampler (bt:make-thread (lambda () (multiple-value-list (sample-pool port stop-flag)))
                                           :name "pool sampler"))
                  (unanswered (unwind-protect (run-load port mode connections seconds tally)
                                (setf (car stop-flag) t)))
                  (timings (bt:join-thread separate))
                  (latencies (sort (remove nil timings) #'<))
                  (most-parked (first (bt:join-thread sampler)))
                  (statistics (server-pool-statistics port))
                  (rss (peak-rss-megabytes (uiop:process-info-pid process))))
             (report-connection-load mode connections seconds tally unanswered timings latencies
                                     statistics most-parked rss)))
      (stop-server process))))

(defun report-connection-load (mode connections seconds tally unanswered timings latencies
                               statistics most-parked rss)
  (let* ((failures (count nil timings))
         (p99 (percentile latencies 0.99))
         (peak-threads (getf statistics :peak-threads))
         (checks
           (if (eq mode :keep-alive)
               `(("every request answered 200" ,(and (zerop unanswered) (zerop (tally-other-status tally))
                                                   (= (tally-ok tally) (- (tally-requests tally) unanswered))))
                 ("no connection refused or reset" ,(and (zerop (tally-connect-failures tally))
                                                         (zerop (tally-closed-by-server tally))))
                 ("pool never above 100 threads" ,(and peak-threads (<= peak-threads 100)))
                 ("separate client p99 under 50 ms, none failed" ,(and (< p99 50) (zerop failures))))
               `(("every slow connection closed was answered 408" ,(zerop (tally-closed-without-408 tally)))
                 ("slow connections answered 408 at the 10 s header timeout"
                  ,(and (tally-seconds-to-408 tally)
                        (every (lambda (s) (<= 9.5 s 12)) (tally-seconds-to-408 tally))))
                 ("separate client p99 under 100 ms, none failed" ,(and (< p99 100) (zerop failures)))))))
    (format t "~&~:[~D kept-alive connections, each sending GET /yo every 1 to 4.9 s~;~D slowloris connections, each sending one header line a second~], for ~D s~%"
            (eq mode :slowloris) connections seconds)
    (format t "connections: ~D opened, ~D failed to connect, ~D closed by the server~%"
            (tally-opened tally) (tally-connect-failures tally) (tally-closed-by-server tally))
    (if (eq mode :keep-alive)
        (format t "requests: ~D sent, ~D answered 200, ~D answered otherwise, ~D unanswered at the end~%"
                (tally-requests tally) (tally-ok tally) (tally-other-status tally) unanswered)
        (let ((times (sort (copy-list (tally-seconds-to-408 tally)) #'<)))
          (format t "slow connections: ~D answered 408 and closed, ~D closed without 408; seconds to 408: min ~,1F median ~,1F max ~,1F~%"
                  (tally-answered-408 tally) (tally-closed-without-408 tally)
                  (if times (first times) 0) (percentile times 0.5) (if times (car (last times)) 0))))
    (format t "server: peak ~D worker threads (max-thread-count 100), peak RSS ~D MB, up to ~D connections parked at once~%"
            peak-threads rss most-parked)
    (when (eq mode :slowloris)
      (format t "server counted ~D header timeouts (408)~%" (getf statistics :header-timeout-replies)))
    (format t "separate client: ~D requests on new connections, ~D failed, p50 ~,1F ms, p99 ~,1F ms, max ~,1F ms~%"
            (length timings) failures (percentile latencies 0.5) p99 (if latencies (car (last latencies)) 0))
    (loop for (description holds) in checks
          do (format t "~:[FAIL~;pass~]: ~A~%" holds description))
    (every #'second checks)))
