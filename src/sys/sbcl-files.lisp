;;;; Files sent with sendfile(2): opened and looked at once, read without
;;;; moving their offset, their paths resolved by the kernel; a file's
;;;; signature, which changes when it is replaced.

(in-package #:hunchentoot-recycling-taskmaster)

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
            (values fd size (+ mtime +unix-epoch-universal-time+))
            (progn (sb-unix:unix-close fd) nil))))))

(defun directory-path-p (namestring)
  "True when NAMESTRING names a directory."
  (multiple-value-bind (ok device inode mode) (sb-unix:unix-stat namestring)
    (declare (ignore device inode))
    (and ok (= (logand mode +s-ifmt+) +s-ifdir+))))

(defun file-signature (namestring)
  "What tells one content of the file NAMESTRING (symbolic links followed)
from the next: its device, inode, size and the seconds of its last
modification and status change, as a list; NIL when it names nothing.  A
rename, a link switched or a rewrite in place each change it."
  (multiple-value-bind (ok device inode mode links uid gid rdev size atime mtime ctime)
      (sb-unix:unix-stat namestring)
    (declare (ignore mode links uid gid rdev atime))
    (and ok (list device inode size mtime ctime))))

(defun send-file-octets (socket-fd file-fd start end)
  "Send the octets of FILE-FD from START below END to the non-blocking
socket SOCKET-FD with sendfile(2), in the kernel, as many as the socket
takes now: their count, 0 when the file ends before START (it was
truncated), :WOULD-BLOCK when the socket buffer is full, or :ERROR."
  (sb-alien:with-alien ((offset (sb-alien:signed 64)))
    (setf offset start)
    (without-blocking
      (sb-alien:alien-funcall
       (sb-alien:extern-alien "sendfile" (function sb-alien:long sb-alien:int sb-alien:int
                                                   (* (sb-alien:signed 64)) sb-alien:unsigned-long))
       socket-fd file-fd (sb-alien:addr offset) (min (- end start) (ash 1 30))))))

(defun duplicate-fd (fd)
  "A new descriptor on what FD is open on (dup(2)), or NIL."
  (sb-unix:unix-dup fd))

(defun read-file-octets (fd buffer position &optional (start 0))
  "Read from FD at POSITION into BUFFER (octets) from START with pread(2),
without moving FD's offset: the count read, 0 at the file's end, NIL on
error."
  (sb-sys:with-pinned-objects (buffer)
    (let ((count (sb-alien:alien-funcall
                  (sb-alien:extern-alien "pread" (function sb-alien:long sb-alien:int sb-sys:system-area-pointer
                                                           sb-alien:unsigned-long (sb-alien:signed 64)))
                  fd (sb-sys:sap+ (sb-sys:vector-sap buffer) start) (- (length buffer) start) position)))
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

(defun append-octets-to-file (namestring octets end)
  "Append the OCTETS below END to the file NAMESTRING, created when it is
not there, opened for this call alone: whatever the name means now (a log
file renamed away is followed by a new one).  NIL once all are written,
else the system's words for what failed."
  (multiple-value-bind (fd errno)
      (sb-unix:unix-open namestring (logior sb-unix:o_wronly sb-unix:o_append sb-unix:o_creat +sock-cloexec+) #o666)
    (if (null fd)
        (sb-int:strerror errno)
        (unwind-protect
             (loop with start = 0
                   while (< start end)
                   do (multiple-value-bind (count errno) (sb-unix:unix-write fd octets start (- end start))
                        (cond (count (incf start count))
                              ((/= errno +eintr+) (return (sb-int:strerror errno))))))
          (sb-unix:unix-close fd)))))
